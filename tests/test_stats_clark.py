"""Clark selector masks and surface statistics on hand-made maps with known answers."""
import math

import numpy as np
import pytest
import torch

from analysis.stats import (
    attention_on,
    attention_to,
    key_selector,
    next_token_selector,
    offset_selector,
    previous_token_selector,
    same_token_selector,
)
from analysis.surface import LabelThresholds, head_labels, surface_batch


def one_hot_rows(targets, width):
    """(n, width) map whose row i puts all weight on key targets[i]."""
    rows = torch.zeros(len(targets), width)
    rows[torch.arange(len(targets)), torch.tensor(targets)] = 1.0
    return rows


def roles_for(kinds, width):
    """token_roles-style masks from a list of kinds per position ('cls', 'sep', '.', ',', 'w'); padding after."""
    def mask(kind):
        out = torch.zeros(1, width, dtype=torch.bool)
        for i, k in enumerate(kinds):
            out[0, i] = k == kind if kind != "real" else True
        return out

    return {"cls": mask("cls"), "sep": mask("sep"), "period": mask("."), "comma": mask(","), "real": mask("real")}


def test_offset_selectors_pick_the_right_pairs_inside_real_length():
    lengths = torch.tensor([3])
    prev = previous_token_selector(lengths, 4)[0]
    nxt = next_token_selector(lengths, 4)[0]
    same = same_token_selector(lengths, 4)[0]
    assert prev.nonzero().tolist() == [[1, 0], [2, 1]]
    assert nxt.nonzero().tolist() == [[0, 1], [1, 2]]  # (2, 3) is padding
    assert same.nonzero().tolist() == [[0, 0], [1, 1], [2, 2]]
    assert torch.equal(offset_selector(lengths, 4, -1), previous_token_selector(lengths, 4))


def test_key_selector_is_sep_to_sep():
    sep = torch.tensor([[False, True, False, True]])
    selector = key_selector(sep, sep)[0]
    assert selector.nonzero().tolist() == [[1, 1], [1, 3], [3, 1], [3, 3]]


def test_attention_on_previous_token_and_sep_sep_known_values():
    # head 0 looks at the previous token (row 0 at itself); head 1 spreads row i evenly over [SEP]s 2 and 4
    prev_map = one_hot_rows([0, 0, 1, 2, 3], 5)
    sep_map = torch.zeros(5, 5)
    sep_map[:, 2] = sep_map[:, 4] = 0.5
    attn = torch.stack([prev_map, sep_map])[None, None]  # (1, 1, 2, 5, 5)
    lengths = torch.tensor([5])
    prev = attention_on(attn, previous_token_selector(lengths, 5))[0, 0]
    assert prev.tolist() == pytest.approx([1.0, 0.5 / 4])  # head 1: only row 3's previous token (2) is a [SEP]
    sep = torch.tensor([[False, False, True, False, True]])
    sep_sep = attention_on(attn, key_selector(sep, sep))[0, 0]
    # head 0: row 2 -> key 1 (no sep), row 4 -> key 3 (no sep) => 0; head 1: all on seps => 1
    assert sep_sep.tolist() == pytest.approx([0.0, 1.0])
    real = torch.ones(1, 5, dtype=torch.bool)
    assert attention_to(attn, sep, real)[0, 0].tolist() == pytest.approx([1 / 5, 1.0])  # head 0: row 3 -> [SEP] 2


def test_surface_batch_known_answers_and_padding_invariance():
    kinds = ["cls", "w", ".", "w", "sep"]
    prev_map = one_hot_rows([0, 0, 1, 2, 3], 5)  # previous token (row 0 itself)
    cls_map = one_hot_rows([0] * 5, 5)  # everything on [CLS]
    uniform = torch.full((5, 5), 0.2)
    attn = torch.stack([prev_map, cls_map, uniform])[None, None]  # (1, 1, 3, 5, 5)
    stats = surface_batch(attn, roles_for(kinds, 5), torch.tensor([5]))
    value = {name: values[0, 0].tolist() for name, (values, _) in stats.items()}
    assert value["prev"] == pytest.approx([1.0, 0.25, 0.2])  # head 1: row 1's previous token is [CLS]
    assert value["next"] == pytest.approx([0.0, 0.0, 0.2])
    assert value["self"] == pytest.approx([0.2, 0.2, 0.2])  # head 0: only row 0 attends to itself
    assert value["cls"] == pytest.approx([0.4, 1.0, 0.2])  # head 0: rows 0 and 1 hit [CLS]
    assert value["period"] == pytest.approx([0.2, 0.0, 0.2])  # row 3 -> '.'
    assert value["comma"] == pytest.approx([0.0, 0.0, 0.0])
    assert value["sep_sep"] == pytest.approx([0.0, 0.0, 0.2])
    assert value["entropy"] == pytest.approx([0.0, 0.0, math.log(5)], abs=1e-6)
    assert value["cls_entropy"] == pytest.approx([0.0, 0.0, math.log(5)], abs=1e-6)

    # the same example padded to 7 next to a longer one gives identical statistics
    padded = torch.zeros(2, 1, 3, 7, 7)
    padded[0, :, :, :5, :5] = attn[0]
    padded[1] = torch.full((1, 3, 7, 7), 1 / 7)
    roles = {name: torch.cat([torch.nn.functional.pad(mask, (0, 2)), torch.zeros(1, 7, dtype=torch.bool)])
             for name, mask in roles_for(kinds, 5).items()}
    roles["real"][1] = True
    batch = surface_batch(padded, roles, torch.tensor([5, 7]))
    for name, (values, _) in stats.items():
        assert torch.allclose(batch[name][0][0], values[0], atol=1e-6), name


def test_head_labels_follow_thresholds_and_clark_precedence():
    zeros = np.zeros((1, 6))
    values = {name: zeros.copy() for name in ("prev", "next", "cls", "sep", "period", "comma")}
    values["entropy"] = np.full((1, 6), 1.0)
    values["next"][0, 0] = 0.6
    values["prev"][0, 1] = 0.6
    values["entropy"][0, 2] = 4.0
    values["cls"][0, 3] = 0.7
    values["period"][0, 4], values["comma"][0, 4] = 0.4, 0.3  # together above 0.6
    values["prev"][0, 5], values["sep"][0, 5] = 0.9, 0.9  # [SEP] overrides prev (Clark's order)
    labels = head_labels(values)
    assert labels.tolist() == [["next", "prev", "broad", "cls", "punct", "sep"]]
    strict = head_labels(values, LabelThresholds(broad=5.0, position=0.95, special=0.95))
    assert strict.tolist() == [["other"] * 6]
