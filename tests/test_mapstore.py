"""The one map format (analysis.mapstore): map ids, whole examples and single heads in one file, the digest,
and the shipped labeled set in that format."""
from __future__ import annotations

import hashlib
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from analysis.data import load_data
from analysis.errors import AttnpatError
from analysis.extract import extract_maps
from analysis.mapstore import (
    FORMAT,
    MapGroup,
    SavedMap,
    iter_map_groups,
    iter_saved_maps,
    make_map_id,
    maps_digest,
    parse_map_id,
    read_maps,
    read_shard,
    read_shard_revision,
    read_single_maps,
    single_map,
    write_maps,
    write_shard,
    write_single_maps,
)
from annotation.dataset import load_labeled_set
from tests.tiny import tiny_bundle

REPO = Path(__file__).resolve().parents[1]


def random_maps(rng, *shape):
    attn = rng.random(shape).astype(np.float32)
    return attn / attn.sum(-1, keepdims=True)


def test_map_ids_round_trip_and_bad_ids_are_refused():
    map_id = make_map_id("minilm", "mrpc", "mrpc-validation-1019", 4, 6)
    assert map_id == "minilm:mrpc:mrpc-validation-1019:L4H6"
    assert parse_map_id(map_id) == ("minilm", "mrpc", "mrpc-validation-1019", 4, 6)
    # an example id may hold ':'; model and task may not (they become '_')
    odd = make_map_id("org:model", "a:b", "file:7", 0, 11)
    assert odd == "org_model:a_b:file:7:L0H11"
    assert parse_map_id(odd) == ("org_model", "a_b", "file:7", 0, 11)
    for bad in ("ex0/L1H1", "minilm:sst2:L1H1", "minilm:sst2:ex:L1", "minilm::ex:L1H1", "minilm:sst2:ex:H1L1"):
        with pytest.raises(AttnpatError, match="is not <model>:<task>:<example>:L<layer>H<head>"):
            parse_map_id(bad)


def test_whole_examples_and_single_heads_share_one_file(tmp_path):
    rng = np.random.default_rng(0)
    whole = SavedMap("ex0", random_maps(rng, 2, 3, 5, 5), list("abcde"), np.asarray([0, 0, 0, 1, 1]), "tiny", "rte")
    with_tokens = single_map(make_map_id("tiny", "sst2", "ex1", 1, 2), random_maps(rng, 4, 4), ["w", "x", "y", "z"])
    bare = single_map(make_map_id("tiny", "sst2", "ex2", 0, 0), random_maps(rng, 6, 6))  # no tokens known
    write_maps(tmp_path / "m.npz", [whole.group(), with_tokens, bare])
    with np.load(tmp_path / "m.npz", allow_pickle=False) as data:  # no pickled objects
        assert str(data["format"]) == FORMAT and data["attn"].dtype == np.float32
    groups = read_maps(tmp_path / "m.npz")
    assert [g.map_ids for g in groups][1:] == [with_tokens.map_ids, bare.map_ids]
    assert groups[0].map_ids[:4] == ["tiny:rte:ex0:L0H0", "tiny:rte:ex0:L0H1", "tiny:rte:ex0:L0H2", "tiny:rte:ex0:L1H0"]
    np.testing.assert_array_equal(groups[0].grid(), whole.attn)
    assert groups[0].tokens == whole.tokens and groups[0].token_type_ids.tolist() == [0, 0, 0, 1, 1]
    assert groups[1].tokens == ["w", "x", "y", "z"] and groups[2].tokens is None
    np.testing.assert_array_equal(groups[2].attn[0], bare.attn[0])  # float32 stays exact
    with pytest.raises(AttnpatError, match="single heads"):
        groups[1].grid()
    singles = read_single_maps(tmp_path / "m.npz")
    assert len(singles) == 2 * 3 + 2 and singles["tiny:rte:ex0:L1H2"].shape == (5, 5)
    np.testing.assert_array_equal(singles["tiny:rte:ex0:L1H2"], whole.attn[1, 2])


def test_extract_shards_are_float16_and_read_back_as_examples(tmp_path):
    rng = np.random.default_rng(1)
    maps = [SavedMap(f"ex{k}", random_maps(rng, 2, 2, n, n), [f"t{i}" for i in range(n)], np.zeros(n), "tiny", "sst2")
            for k, n in enumerate((3, 4))]
    write_shard(tmp_path / "shard.npz", maps)
    with np.load(tmp_path / "shard.npz", allow_pickle=False) as data:
        assert data["attn"].dtype == np.float16
    back = read_shard(tmp_path / "shard.npz")
    assert [m.example_id for m in back] == ["ex0", "ex1"] and back[1].model == "tiny" and back[1].task == "sst2"
    np.testing.assert_allclose(back[1].attn, maps[1].attn, atol=1e-3)
    assert [g.map_ids[-1] for g in iter_map_groups(tmp_path)] == ["tiny:sst2:ex0:L1H1", "tiny:sst2:ex1:L1H1"]


def test_a_map_id_twice_in_a_folder_must_hold_the_same_map(tmp_path):
    rng = np.random.default_rng(5)
    map_id = make_map_id("m", "t", "e", 0, 0)
    first = random_maps(rng, 4, 4)
    write_single_maps(tmp_path / "a.npz", {map_id: first})
    write_single_maps(tmp_path / "b.npz", {map_id: first})
    assert np.array_equal(read_single_maps(tmp_path)[map_id], first)  # a copy of the same map is one map
    write_single_maps(tmp_path / "b.npz", {map_id: random_maps(rng, 4, 4)})
    with pytest.raises(AttnpatError, match="twice with different values"):
        read_single_maps(tmp_path)


def test_earlier_layouts_and_foreign_files(tmp_path):
    rng = np.random.default_rng(2)
    ids = [make_map_id("m", "t", "e", 0, h) for h in range(2)]
    old = [random_maps(rng, 3, 3), random_maps(rng, 4, 4)]
    np.savez_compressed(tmp_path / "single.npz", attn=np.concatenate([m.ravel() for m in old]),
                        lengths=np.asarray([3, 4], np.int32), map_ids=np.asarray(ids))
    back = read_single_maps(tmp_path / "single.npz")  # samples pushed before the one format still pull
    assert list(back) == ids and all(np.array_equal(back[i], m) for i, m in zip(ids, old, strict=True))
    np.savez_compressed(tmp_path / "oldshard.npz", attn=np.zeros(9, np.float16), lengths=np.asarray([3]),
                        shape=np.asarray([1, 1]), example_ids=np.asarray(["e"]))
    with pytest.raises(AttnpatError, match="extract again"):
        read_maps(tmp_path / "oldshard.npz")
    np.savez_compressed(tmp_path / "future.npz", format=np.asarray("attnpat-maps/9"))
    with pytest.raises(AttnpatError, match="expected 'attnpat-maps/1'"):
        read_maps(tmp_path / "future.npz")
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(AttnpatError, match="not an attnpat map file"):
        read_maps(tmp_path / "junk.npz")
    with pytest.raises(AttnpatError, match="no maps"):
        write_maps(tmp_path / "empty.npz", [])
    group = MapGroup("m", "t", "e", np.asarray([[0, 0]]), np.zeros((1, 3, 3), np.float32), ["a", "b"])
    with pytest.raises(AttnpatError, match="3 tokens long but come with 2 tokens"):
        write_maps(tmp_path / "bad.npz", [group])
    assert not (tmp_path / "bad.npz").exists()


def test_one_digest_for_one_map_a_pool_and_a_labeled_set():
    rng = np.random.default_rng(3)
    maps = [random_maps(rng, 3, 3), random_maps(rng, 5, 5)]
    assert maps_digest(maps[:1]) == hashlib.sha256(maps[0].tobytes()).hexdigest()
    by_hand = hashlib.sha256()
    for map_id, label, attn in zip(["a", "b"], [1, 4], maps, strict=True):
        by_hand.update(map_id.encode() + bytes([label]) + attn.tobytes())
    assert maps_digest(maps, ["a", "b"], [1, 4]) == by_hand.hexdigest()
    assert len({maps_digest(maps), maps_digest(maps, ["a", "b"]), maps_digest(maps, labels=[1, 4]),
                maps_digest(maps[::-1]), maps_digest(maps, ["a", "b"], [1, 3])}) == 5


def test_shipped_labeled_set_is_in_the_one_format_and_matches_the_checkpoint_record():
    folder = REPO / "annotation" / "labeled" / "v2"
    with np.load(folder / "maps.npz", allow_pickle=False) as data:
        assert str(data["format"]) == FORMAT
    labeled = load_labeled_set(folder)
    labels = pd.read_csv(folder / "labels.csv")
    assert labeled.map_ids == list(labels.map_id) and len(labeled) == 990
    assert all(parse_map_id(map_id).model == "minilm" for map_id in labeled.map_ids)
    metadata = json.loads((REPO / "classifier" / "checkpoints" / "default.json").read_text())
    trained_on = REPO / metadata["trained_on"].removeprefix("labeled set ")
    if trained_on.resolve() == folder.resolve():
        assert labeled.data_hash == metadata["data_hash"]  # the maps and labels the checkpoint was trained on
    else:
        assert load_labeled_set(trained_on).data_hash == metadata["data_hash"]


def test_single_maps_keep_their_tokens(tmp_path):
    rng = np.random.default_rng(4)
    ids = [make_map_id("m", "t", f"e{k}", 0, 0) for k in range(3)]
    maps = {map_id: random_maps(rng, 4, 4) for map_id in ids}
    write_single_maps(tmp_path / "s.npz", maps, {ids[0]: ["a", "b", "c", "d"]})
    groups = read_maps(tmp_path / "s.npz")
    assert [g.tokens for g in groups] == [["a", "b", "c", "d"], None, None]


def test_an_unfinished_extraction_is_not_read_as_a_whole_data_set(tmp_path):
    """A killed `attnpat extract` leaves the shards of its shortest examples (shards are length-sorted) and an
    index saying it is not complete; reading that folder (classify --maps, annotate push --maps) is one error,
    not ratios over a short-biased part of the data. Finished, the same folder reads whole."""
    bundle = tiny_bundle(tmp_path / "model")
    data = load_data("sst2", n=6)
    folder = tmp_path / "maps"
    extract_maps(bundle, data, folder, shard_size=2, progress=False)
    assert len(list(iter_map_groups(folder))) == 6
    index = json.loads((folder / "index.json").read_text())
    (folder / "index.json").write_text(json.dumps({**index, "complete": False}))  # as a kill leaves it
    (folder / "shard-00002.npz").unlink()
    for read in (iter_map_groups, read_single_maps):
        with pytest.raises(AttnpatError, match="unfinished extraction.*attnpat extract"):
            list(read(folder))
    assert len(read_maps(folder / "shard-00000.npz")) == 2  # one shard named on its own still reads
    (folder / "index.json").write_text(json.dumps(index))  # complete, yet a shard is gone
    with pytest.raises(AttnpatError, match="shard-00002.npz"):
        list(iter_map_groups(folder))
    extract_maps(bundle, data, folder, shard_size=2, progress=False)  # the rerun finishes it
    assert sorted(g.example_id for g in iter_map_groups(folder)) == sorted(e.id for e in data.examples)


def test_an_extraction_refuses_shards_whose_index_was_deleted(tmp_path):
    """index.json deleted by hand, then `extract` run again with other settings (here another --n): the rerun took
    the shards whose names it expected as its own, whatever examples they held, and left the rest, which every
    reader of the folder took in. Nothing tells what such shards hold: the rerun stops with one line, writes
    nothing and deletes nothing; once they are removed it extracts afresh."""
    bundle = tiny_bundle(tmp_path / "model")
    folder = tmp_path / "maps"
    extract_maps(bundle, load_data("sst2", n=6), folder, shard_size=2, progress=False)
    (folder / "index.json").unlink()
    left = {path.name: path.read_bytes() for path in folder.iterdir()}
    fewer = load_data("sst2", n=2)
    refusal = (r"maps holds 3 map shard\(s\) \(shard-\*\.npz\) but no index.json .*; remove them \(or the "
               r"folder\) to extract afresh, or choose another --out$")
    with pytest.raises(AttnpatError, match=refusal):
        extract_maps(bundle, fewer, folder, shard_size=2, progress=False)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == left
    for shard in folder.glob("shard-*.npz"):
        shard.unlink()
    extract_maps(bundle, fewer, folder, shard_size=2, progress=False)
    assert sorted(g.example_id for g in iter_map_groups(folder)) == sorted(e.id for e in fewer.examples)


def test_a_map_file_with_a_few_bytes_overwritten_is_one_error(tmp_path):
    """Bytes overwritten in a map file's zip directory (a bad copy, a failing disk) could name a compression method,
    zip version or encryption that zipfile refuses (NotImplementedError, RuntimeError), and a member that is not a
    .npy array loads as raw bytes (AttributeError): each was a traceback, and is now one error line."""
    rng = np.random.default_rng(6)
    write_shard(tmp_path / "good.npz", [SavedMap("ex0", random_maps(rng, 2, 2, 4, 4), list("abcd"), np.zeros(4),
                                                 "tiny", "sst2")])
    content = (tmp_path / "good.npz").read_bytes()
    entry = content.index(b"PK\x01\x02")  # the first member's central directory entry
    damages = {"method": (entry + 10, (99).to_bytes(2, "little")),  # AES: "compression method not supported"
               "version": (entry + 6, (99).to_bytes(2, "little")),  # "zip file version 9.9"
               "encrypted": (entry + 8, (1).to_bytes(2, "little"))}  # "password required"
    for name, (at, value) in damages.items():
        damaged = bytearray(content)
        damaged[at:at + 2] = value
        (tmp_path / f"{name}.npz").write_bytes(bytes(damaged))
    with zipfile.ZipFile(tmp_path / "raw.npz", "w") as archive:  # members without the .npy header
        archive.writestr("format.npy", FORMAT)
        archive.writestr("attn.npy", b"\0" * 16)
    for name in (*damages, "raw"):
        with pytest.raises(AttnpatError, match="is not an attnpat map file"):
            read_maps(tmp_path / f"{name}.npz")


def direct_maps(bundle, example, max_length: int) -> tuple[np.ndarray, list[str]]:
    """(L, H, n, n) float32 maps of one example by a forward pass of its own (no batch, no padding), and its tokens."""
    parts = (example.text,) if example.text_pair is None else (example.text, example.text_pair)
    encoded = bundle.tokenizer(*parts, truncation=True, max_length=max_length, return_tensors="pt")
    with torch.no_grad():
        attentions = bundle.model(**encoded, output_attentions=True).attentions
    return torch.stack(attentions, 1)[0].numpy(), bundle.tokenizer.convert_ids_to_tokens(encoded["input_ids"][0])


def test_extracted_maps_are_the_direct_float32_maps_within_the_documented_tolerance(tmp_path):
    """Each stored map, read back, is the example's own unpadded forward pass within 2.5e-4 (float16's half step
    below 1, what `attnpat extract --help` states), cropped to its real tokens, layer by layer and head by head,
    under its example id; rows still sum to 1 within 5e-4; truncation by --max-length is counted in the index."""
    bundle = tiny_bundle(tmp_path / "model", layers=3, heads=4)
    rows = [{"text": " ".join(["the cat sat on the mat ."] * repeats)}
            for repeats in (1, 9, 3, 20, 2)]
    (tmp_path / "d.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = load_data(str(tmp_path / "d.jsonl"))
    summary = extract_maps(bundle, data, tmp_path / "maps", max_length=48, shard_size=2, batch_size=3, progress=False)
    saved = {m.example_id: m for m in iter_saved_maps(tmp_path / "maps")}
    assert sorted(saved) == sorted(example.id for example in data.examples) and len(saved) == len(rows)
    for example in data.examples:
        expected, tokens = direct_maps(bundle, example, 48)
        got = saved[example.id]
        assert got.attn.shape == expected.shape == (3, 4, len(tokens), len(tokens)) and got.tokens == tokens
        assert np.abs(got.attn - expected).max() <= 2.5e-4
        assert np.abs(got.attn.sum(-1) - 1).max() <= 5e-4
    index = json.loads((tmp_path / "maps" / "index.json").read_text())
    assert summary["n_truncated"] == index["n_truncated"] == 2 and index["max_length"] == 48  # 9 and 20 repeats


def test_a_shard_of_other_weights_of_the_same_model_is_refused_on_read_and_on_resume(tmp_path):
    """Two revisions of one model (same folder name, so the same model slug and map ids) extracted on the same
    examples: a shard of one copied into the other's folder passed the shard check (index.json recorded only the
    shard's model name, task and examples) and was read, or resumed, as the other's maps. Now each shard records
    the model weights' identity (EncoderBundle.revision, already computed at load: no extra hashing) and readers
    and a rerun refuse it with one line; nothing is written or deleted."""
    old = tiny_bundle(tmp_path / "v1" / "model", seed=0)
    new = tiny_bundle(tmp_path / "v2" / "model", seed=1)
    assert old.slug == new.slug and old.revision != new.revision
    sst2 = load_data("sst2", n=6)
    extract_maps(old, sst2, tmp_path / "a", shard_size=2, progress=False)
    extract_maps(new, sst2, tmp_path / "b", shard_size=2, progress=False)
    assert read_shard_revision(tmp_path / "a" / "shard-00001.npz") == old.revision
    folder = tmp_path / "a"
    shutil.copy(tmp_path / "b" / "shard-00001.npz", folder / "shard-00001.npz")
    for read in (iter_map_groups, iter_saved_maps, read_single_maps):
        with pytest.raises(AttnpatError, match=rf"shard-00001\.npz holds maps of other weights of the model than its "
                                               rf"extraction's \(revision {new.revision}, not {old.revision} as "
                                               r"index\.json records\); remove it and run the same `attnpat extract` "
                                               r"again$"):
            list(read(folder))
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    with pytest.raises(AttnpatError, match=r"shard-00001\.npz holds maps of other weights of the model than this "
                                           r"extraction's \(revision .*; 1 such shard\(s\)\); remove them"):
        extract_maps(old, sst2, folder, shard_size=2, progress=False)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before
    (folder / "shard-00001.npz").unlink()
    assert extract_maps(old, sst2, folder, shard_size=2, progress=False)["resumed_shards"] == 2
    assert len(list(iter_map_groups(folder))) == 6


def test_a_map_file_that_is_not_the_extractions_is_refused_on_read_and_on_resume(tmp_path):
    """A shard of another extraction copied over one of a finished extraction, or a map file added beside its
    shards: every reader took them in as part of the extraction (maps of another task or model, or examples twice),
    and a rerun resumed the copied shard as its own. Now a reader stops with one line naming the file (index.json
    records what each shard holds), and so does a rerun, which writes and deletes nothing."""
    bundle = tiny_bundle(tmp_path / "model")
    sst2 = load_data("sst2", n=6)
    extract_maps(bundle, sst2, tmp_path / "a", shard_size=2, progress=False)
    extract_maps(bundle, load_data("mrpc", n=6), tmp_path / "b", shard_size=2, progress=False)
    folder = tmp_path / "a"
    shutil.copy(tmp_path / "b" / "shard-00002.npz", folder / "extra.npz")
    with pytest.raises(AttnpatError, match=r"holds extra\.npz, which its extraction \(index.json: 3 shards\) did "
                                           r"not write .*; move them out of the folder$"):
        list(iter_map_groups(folder))
    (folder / "extra.npz").unlink()
    shutil.copy(tmp_path / "b" / "shard-00001.npz", folder / "shard-00001.npz")
    for read in (iter_map_groups, iter_saved_maps, read_single_maps):
        with pytest.raises(AttnpatError, match=r"shard-00001\.npz holds other maps than its extraction wrote .*"
                                               r"remove it and run the same `attnpat extract` again$"):
            list(read(folder))
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    with pytest.raises(AttnpatError, match=r"shard-00001\.npz holds other maps than this extraction puts there"):
        extract_maps(bundle, sst2, folder, shard_size=2, progress=False)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before
    (folder / "shard-00001.npz").unlink()  # as the line says: the rerun makes it again
    summary = extract_maps(bundle, sst2, folder, shard_size=2, progress=False)
    assert summary["resumed_shards"] == 2
    assert sorted(g.example_id for g in iter_map_groups(folder)) == sorted(e.id for e in sst2.examples)
