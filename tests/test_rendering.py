"""The guideline's rendering: absolute weights, crisp cells, marks outside the map, cues."""
import numpy as np
import pytest

from analysis.errors import AttnpatError
from analysis.rendering import GAP, STRIP, absolute_grey, cell_size, cue_text, map_cues, render_map


def test_absolute_scale_is_the_same_for_every_map():
    """A uniform map is the same light grey whatever its maximum; a per-map scale would make it black."""
    uniform = np.full((100, 100), 0.01, dtype=np.float32)
    grey = absolute_grey(uniform)
    assert np.all(grey == grey[0, 0]) and 220 <= grey[0, 0] <= 235  # 1 - sqrt(0.01) = 0.9 of white
    assert absolute_grey(np.eye(3, dtype=np.float32))[0, 0] == 0  # weight 1 is black


def test_one_token_column_stays_visible_at_128_tokens():
    attn = np.full((128, 128), 0.5 / 127, dtype=np.float32)
    attn[:, 5] = 0.5
    image = np.asarray(render_map(attn, inset=False).convert("L"))
    cell = cell_size(128)
    assert cell >= 3
    column = image[STRIP:, STRIP + 5 * cell:STRIP + 6 * cell]
    neighbour = image[STRIP:, STRIP + 7 * cell:STRIP + 8 * cell]
    assert column.max() < 90 and neighbour.min() > 200  # crisp: no blur into the neighbouring column


def test_marks_sit_outside_the_map():
    tokens = ["[CLS]", "a", ",", "b", "[SEP]"]
    attn = np.full((5, 5), 0.2, dtype=np.float32)
    image = np.asarray(render_map(attn, tokens, inset=False))
    cell = cell_size(5)
    red = image[0, STRIP + cell // 2]
    assert red[0] > 150 and red[1] < 100  # [CLS] mark above its column
    inside = image[STRIP:, STRIP:]
    assert np.all(inside[..., 0] == inside[..., 1])  # the map itself stays grey


def test_cues_of_known_maps():
    n = 20
    column = np.zeros((n, n), dtype=np.float32)
    column[:, 0] = 1.0
    cues = map_cues(column)
    assert cues["top_column"] == pytest.approx(1.0) and cues["rows_on_top_column"] == pytest.approx(1.0)
    uniform = np.full((n, n), 1 / n, dtype=np.float32)
    cues = map_cues(uniform)
    assert cues["broadness"] == pytest.approx(1.0, abs=1e-5)
    assert cues["excess_over_uniform"] == pytest.approx(0, abs=1e-5)
    assert map_cues(np.eye(n, dtype=np.float32))["band"] == pytest.approx(1.0)
    assert "([CLS])" in cue_text(column, ["[CLS]"] + ["x"] * (n - 1))
    # one key per row: an entropy of -0.0, shown to annotators as 0.00, not -0.00
    for one_key in (column, np.eye(n, dtype=np.float32)):
        assert "broadness 0.00 |" in cue_text(one_key) and "-0" not in cue_text(one_key)


@pytest.mark.parametrize("bad", [np.zeros((3, 4)), np.full((2, 2), np.nan), -np.ones((2, 2)), np.zeros((0, 0))])
def test_bad_maps_get_one_line_errors(bad):
    with pytest.raises(AttnpatError):
        render_map(bad)


def test_the_apps_large_map_uses_the_guidelines_absolute_scale():
    """The web app's large map sits beside the class predicted for it: drawn as the annotators saw their maps,
    a near-uniform map is the same light grey as in render_map (before, scaled to its own maximum, it was black)."""
    from analysis.figures import close, map_figure  # noqa: PLC0415 (matplotlib only for this test)

    uniform = np.full((100, 100), 0.01, dtype=np.float32)
    fig = map_figure(uniform, ["[CLS]"] + ["w"] * 98 + ["[SEP]"])
    try:
        image = fig.axes[0].images[0]
        shown = image.to_rgba(image.get_array())[..., 0] * 255
        assert np.allclose(shown, absolute_grey(uniform), atol=1) and image.get_interpolation() == "nearest"
    finally:
        close(fig)


def test_a_three_token_map_gives_known_pixels():
    """Column 0 holds 0.25 and column 1 0.75 of every row: the main panel's greys are 255 (1 - sqrt(w)), a whole
    number of pixels per token; the inset's are linear in w / 0.75."""
    attn = np.zeros((3, 3), dtype=np.float32)
    attn[:, 0], attn[:, 1] = 0.25, 0.75
    image = np.asarray(render_map(attn).convert("L")).astype(int)
    cell, side = cell_size(3), cell_size(3) // 4
    main = image[STRIP:STRIP + 3 * cell, STRIP:STRIP + 3 * cell]
    assert np.array_equal(main, np.kron(np.array([[128, 34, 255]] * 3), np.ones((cell, cell), dtype=int)))
    left = STRIP + 3 * cell + GAP
    inset = image[STRIP:STRIP + 3 * side, left:left + 3 * side]
    assert np.array_equal(inset, np.kron(np.array([[170, 0, 255]] * 3), np.ones((side, side), dtype=int)))
    assert np.array_equal(np.asarray(render_map(np.ones((1, 1)), inset=False).convert("L")),
                          np.pad(np.zeros((cell_size(1), cell_size(1))), ((STRIP, 0), (STRIP, 0)), constant_values=255))


@pytest.mark.parametrize(("bad", "said"), [(np.zeros((4, 4)), "row 0 sums to 0"),
                                           (np.full((3, 3), 5.0), "maximum of 5"),
                                           (np.full((3, 3), 0.1), "row 0 sums to 0.3")])
def test_a_map_that_is_not_attention_weights_is_refused_not_drawn_blank_or_black(bad, said):
    """Before, a map of zeros was drawn all white, weights above 1 all black and rows summing to 0.3 as faint
    attention: pictures an annotator would label as if they were attention maps."""
    with pytest.raises(AttnpatError, match=said):
        render_map(bad)


def test_the_apps_large_map_refuses_an_empty_map_and_weights_above_one():
    """The large map checks maps as render_map does, rows aside (a map without [CLS]/[SEP] loses their weight):
    before, an empty map drew an empty figure and weights above 1 were all black."""
    from analysis.figures import close, map_figure  # noqa: PLC0415 (matplotlib only for this test)

    for bad in (np.zeros((0, 0)), np.full((3, 3), 2.0)):
        with pytest.raises(AttnpatError):
            map_figure(bad)
    close(map_figure(np.full((3, 3), 0.2)))  # rows of 0.6: a map without its special tokens is drawn


def runs_of(row: np.ndarray) -> list[tuple[int, int]]:
    """(value, length) of each run of equal values along a row of pixels."""
    edges = np.flatnonzero(np.diff(row)) + 1
    starts, ends = np.r_[0, edges], np.r_[edges, len(row)]
    return [(int(row[start]), int(end - start)) for start, end in zip(starts, ends)]


@pytest.mark.parametrize("n", [17, 128, 200])
def test_the_apps_large_map_gives_every_token_the_same_whole_number_of_pixels(tmp_path, n):
    """Saved as the app saves it, every token column of the large map is cell_size(n) pixels wide, as in render_map:
    before, the map was resampled to its axes, and at 128 tokens its columns were 4 to 6 pixels wide."""
    from PIL import Image  # noqa: PLC0415

    from analysis.figures import close, map_figure  # noqa: PLC0415 (matplotlib only for this test)
    from analysis.rundir import save_figure  # noqa: PLC0415

    attn = np.zeros((n, n), dtype=np.float32)
    attn[:, 1::2] = 0.25  # every other key 0.25 (grey 128), the rest 0 (white): alternating one-token columns
    fig = map_figure(attn, ["[CLS]"] + ["w"] * (n - 2) + ["[SEP]"], all_ticks=n <= 64, title="t")
    png = save_figure(fig, tmp_path / "map")[0]
    close(fig)
    image = np.asarray(Image.open(png).convert("L")).astype(int)
    cell = cell_size(n)
    # pixel columns grey over most of the map's height: the map's grey token columns (no label text is that tall)
    grey = (image == 128).sum(0) >= n * cell // 2
    runs = runs_of(grey.astype(int))
    first = next(k for k, (value, _) in enumerate(runs) if value)
    last = max(k for k, (value, _) in enumerate(runs) if value)
    inside = runs[first:last + 1]  # grey, white, grey, ..., grey
    assert len(inside) == 2 * (n // 2) - 1 and {length for _, length in inside} == {cell}
