"""Fine-tuning verbs: finetune, compare (attention change after fine-tuning), special (special tokens and
linguistic features). Kovaleva et al. Figures 5-7 and section 4.4."""
from __future__ import annotations

import typer

from analysis import finetune as ft
from analysis.compare import MODES, check_comparable, write_cosine
from analysis.data import load_data
from analysis.errors import AttnpatError
from analysis.models import DEFAULT_MODEL, load_model
from analysis.rundir import RunDir
from analysis.special import (
    encode_special_inputs,
    held_out_change,
    spacy_tagger,
    unpaired_reason,
    write_feature_change,
    write_special,
)
from analysis.stats import per_layer_table
from app import options as opt
from app.display import interval_text, layer_interval_lines


def register(app: typer.Typer) -> None:
    app.command("finetune")(finetune)
    app.command("compare")(compare)
    app.command("special")(special)


GlueTask = typer.Option("sst2", "--task", "-t",
                        help=f"a GLUE task: {', '.join(ft.GLUE_TASKS)} (offline: sst2, and mrpc and rte with "
                             "--split-dev; the others from the hub)")


def finetune(model: str = opt.Model, task: str = GlueTask,
             name: str | None = typer.Option(None, "--name", help="model-store name (default: <model>-<task>)"),
             learning_rate: float = typer.Option(2e-5, "--lr", help="peak learning rate"),
             batch_size: int = opt.batch_size_option(32, "training batch size"),
             epochs: int = typer.Option(3, "--epochs", help="training epochs"),
             max_length: int = opt.MaxLength,
             seed: int = opt.seed_option("seed for the head, dropout, batch order and --split-dev"),
             split_dev: bool = typer.Option(False, "--split-dev",
                                            help="train on a seeded share of the dev set, evaluate on the rest"),
             train_share: float | None = typer.Option(None, "--train-share",
                                                      help="with --split-dev: share used for training (default 0.5)"),
             n: opt.OptionalInt = opt.n_option(None, "train on a seeded sample of N training examples"),
             checkpoint_every: int = typer.Option(50, "--checkpoint-every", help="checkpoint every K steps"),
             force: bool = typer.Option(False, "--force", help="retrain even if the model is finished"),
             device: str | None = typer.Option(None, "--device", help="cpu or cuda (default: GPU when present)"),
             runs_dir: opt.OptionalPath = opt.RunsDir, quiet: bool = opt.Quiet) -> None:
    """Fine-tune a model on a GLUE task into the local model store (resumable; rerun to continue)."""
    if train_share is not None and not split_dev:  # the train split is trained on whole: the share would be ignored
        raise AttnpatError(f"--train-share {train_share} splits the dev set, so it needs --split-dev; without it the "
                           "train split is trained on")
    train_share = 0.5 if train_share is None else train_share
    recipe = ft.Recipe(learning_rate=learning_rate, batch_size=batch_size, epochs=epochs, max_length=max_length,
                       seed=seed)
    meta = ft.finetune(model, task, name=name, recipe=recipe, split_dev=split_dev, train_share=train_share,
                       n_train=n, force=force, checkpoint_every=checkpoint_every, progress=not quiet, device=device,
                       runs_dir=runs_dir)
    store_name = meta["path"].rstrip("/").rsplit("/", 1)[-1]
    if meta["skipped"]:
        differences = meta.get("other_settings") or []
        typer.echo(f"{store_name} is already fine-tuned ({meta['metric']} {meta['metric_value']:.4f}"
                   f"{_interval_text(meta)})" + (f" with other settings ({'; '.join(differences)})"
                                                  if differences else "") + "; use --force to retrain")
        if meta.get("eval_written"):
            written = RunDir(store_name, meta["task"], runs_dir).file("finetune_eval.csv")
            typer.echo(f"its evaluation, from the model store's record: {written}")
        return
    typer.echo(f"fine-tuned {model} on {meta['task']} in {meta['elapsed_seconds']:.0f} s on {meta['device']} "
               f"({meta['steps']} steps; {meta['split']['n_train']} train examples from {meta['train_source']})")
    if meta["split"]["mode"] == "split-dev":
        typer.echo(meta["split"]["note"])
    typer.echo(f"{meta['metric']} on {meta['split']['n_eval']} {meta['split']['eval_split']} examples: "
               f"{meta['metric_value']:.4f}{_interval_text(meta)}")
    typer.echo(f"saved as '{store_name}' ({meta['path']}); use --model {store_name} with any command")


def _interval_text(meta: dict) -> str:
    """', 95% interval LOW-HIGH' of a store model's metric ('' for a model fine-tuned before intervals were kept)."""
    scores, name = meta.get("scores") or {}, meta["metric"]
    if f"{name}_ci_low" not in scores:
        return ""
    return f", 95% interval {scores[f'{name}_ci_low']:.4f}-{scores[f'{name}_ci_high']:.4f}"


def compare(base: str | None = typer.Option(None, "--base", help="the model before fine-tuning (default: the "
                                            "fine-tuned model's base from the model store, else minilm)"),
            finetuned: str = typer.Option(..., "--finetuned", help="the fine-tuned model (model-store name or path)"),
            task: str = opt.Task,
            n: int = opt.n_option(1000, "compare on the first N dev examples (the paper: up to 1000); of a "
                                      "--split-dev model's own dev set, the first N it was not trained on"),
            mode: str = typer.Option("both", "--mode", help="cropped (real tokens), padded (the paper's fixed "
                                     "length) or both"),
            split: str = opt.Split, max_length: int = opt.MaxLength,
            batch_size: int = opt.batch_size_option(16),
            patterns: bool = typer.Option(True, "--patterns/--no-patterns",
                                          help="also classify every head of both models (pattern transitions)"),
            classifier: opt.OptionalPath = typer.Option(None, "--classifier",
                                                        help="pattern CNN checkpoint (default: the shipped one)"),
            text_column: opt.OptionalStr = opt.TextColumn, label_column: opt.OptionalStr = opt.LabelColumn,
            pair_column: opt.OptionalStr = opt.PairColumn,
            runs_dir: opt.OptionalPath = opt.RunsDir, quiet: bool = opt.Quiet) -> None:
    """Per-head cosine similarity of base and fine-tuned attention maps on the same inputs (Kovaleva Fig. 5), and
    the 5x5 matrix of pattern classes base -> fine-tuned over every head and example."""
    modes = MODES if mode == "both" else (mode,)
    if any(m not in MODES for m in modes):
        raise AttnpatError(f"unknown --mode '{mode}'; use cropped, padded or both")
    data = load_data(task, split, n, text_column=text_column, pair_column=pair_column, label_column=label_column)
    tuned_bundle = load_model(finetuned)
    base = base or tuned_bundle.meta.get("base_model") or DEFAULT_MODEL
    base_bundle = load_model(base)
    check_comparable(base_bundle, tuned_bundle, data.task)
    data, left_out = ft.held_out_data(data, tuned_bundle.meta, n, lambda: load_data(
        task, split, None, text_column=text_column, pair_column=pair_column, label_column=label_column))
    run = RunDir(tuned_bundle.slug, data.task, runs_dir)
    if patterns:
        # the classifier package loads torchvision and the CNN (seconds): only when the transitions are wanted;
        # loaded before the cosine tables are written, so a bad --classifier leaves nothing behind
        from classifier.predict import load_classifier  # noqa: PLC0415
        from classifier.transitions import write_transitions  # noqa: PLC0415

        pattern_classifier = load_classifier(str(classifier) if classifier else None)
    values, layer_intervals = write_cosine(base_bundle, tuned_bundle, data, run, modes=modes, max_length=max_length,
                                           batch_size=batch_size, progress="comparing" if not quiet else False)
    held_out = f", leaving out {left_out} it was trained on (--split-dev){short_of_n(data, n)}" if left_out else ""
    typer.echo(f"{base} vs {finetuned} on {data.task} ({len(data.examples)} {data.split} examples{held_out}); "
               "mean cosine per layer [bootstrap 95% interval] (layers 1-indexed):")
    for line in layer_interval_lines(per_layer_table(values, layer_intervals), {name: name for name in values}):
        typer.echo(line)
    typer.echo(f"per-head table and heatmap: {run.file('cosine.csv')}, {run.file('cosine.png')}")
    if patterns:
        counts, intervals = write_transitions(base_bundle, tuned_bundle, data, run, pattern_classifier,
                                              max_length=max_length, batch_size=batch_size,
                                              progress="classifying" if not quiet else False)
        kept = interval_text(counts.trace() / max(counts.sum(), 1), *intervals["unchanged"], spec=".1%")
        typer.echo(f"pattern class kept by {kept} of {counts.sum()} maps (heads x examples; bootstrap 95% interval "
                   "over the examples); matrix (rows: base class, columns: fine-tuned class): "
                   f"{run.file('pattern_transitions.csv')}, {run.file('pattern_transitions.png')}")


def short_of_n(data, n: int | None) -> str:
    """'; only K examples it was not trained on, fewer than --n N' where a --split-dev model's held-out examples
    are fewer than --n ('' otherwise)."""
    if n is None or len(data.examples) >= n:
        return ""
    return f"; only {len(data.examples)} {data.split} examples it was not trained on, fewer than --n {n}"


def strongest_head_text(means, intervals, strongest: dict) -> str:
    """', strongest head L1-H2 0.300 [0.200, 0.400] in-sample (optimistic: the best of all heads); picked on half
    the inputs: L1-H2, 0.250 [0.150, 0.350] on the other 3' from a feature's (L, H) means, (L, H, 2) intervals and
    analysis.special.strongest_heads."""
    best = (strongest["layer"], strongest["head"])
    text = (f", strongest head L{best[0] + 1}-H{best[1] + 1} {interval_text(means[best], *intervals[best])} in-sample "
            "(optimistic: the best of all heads)")
    held = strongest["held_out"]
    if held is None:
        return text + "; too few inputs to pick it on half and score it on the other"
    return (text + f"; picked on half the inputs: L{held['layer'] + 1}-H{held['head'] + 1}, "
            f"{interval_text(held['mean'], held['ci_low'], held['ci_high'])} on the other {held['inputs']}")


def special(model: str = opt.Model, task: str = opt.Task, n: opt.OptionalInt = opt.N,
            base: str | None = typer.Option(None, "--base", help="also analyse this model (default: the "
                                               "fine-tuned model's base from the model store)"),
            no_base: bool = typer.Option(False, "--no-base", help="analyse --model only"),
            top: int = typer.Option(10, "--top", min=1,
                                    help="show the N tokens the last layer's [CLS] attends to most"),
            split: str = opt.Split, max_length: int = opt.MaxLength, batch_size: int = opt.BatchSize,
            text_column: opt.OptionalStr = opt.TextColumn, label_column: opt.OptionalStr = opt.LabelColumn,
            pair_column: opt.OptionalStr = opt.PairColumn,
            map_kind: str = opt.MapKind, runs_dir: opt.OptionalPath = opt.RunsDir, quiet: bool = opt.Quiet) -> None:
    """Attention to [CLS]/[SEP], the last layer's [CLS] row and to linguistic features (Kovaleva Fig. 6-7, 4.4)."""
    if no_base and base:
        raise AttnpatError("--base and --no-base together: give one (--no-base analyses --model alone)")
    data = load_data(task, split, n, text_column=text_column, pair_column=pair_column, label_column=label_column)
    bundle = load_model(model, map_kind=map_kind)
    data, left_out = ft.held_out_data(data, bundle.meta, n, lambda: load_data(
        task, split, None, text_column=text_column, pair_column=pair_column, label_column=label_column))
    if left_out:
        typer.echo(f"leaving out {left_out} of the {data.split} examples {model} was trained on (--split-dev)"
                   f"{short_of_n(data, n)}")
    names = [model]
    base = None if no_base else base or bundle.meta.get("base_model")
    if base and base != model:
        names.append(base)
    # every model loads before the first table is written: a bad --base leaves no half-done run behind
    bundles = {name: bundle if name == model else load_model(name, map_kind=map_kind) for name in names}
    for current in bundles.values():  # and inputs a model cannot analyse are refused before either model's tables
        encode_special_inputs(current.tokenizer, data.examples, max_length)
    unpaired = unpaired_reason(bundle, bundles[names[1]]) if len(names) > 1 else None
    tagger = spacy_tagger()
    all_stats = {}
    for name, current in bundles.items():
        run = RunDir(current.slug, data.task, runs_dir)
        stats = all_stats[name] = write_special(current, data, run, max_length=max_length, batch_size=batch_size,
                                                tagger=tagger, progress=f"{name}" if not quiet else False, top=top,
                                                retire_change=name == model)
        heads, intervals, overall = stats["heads"], stats["intervals"], stats["model_intervals"]
        typer.echo(f"{name} on {data.task} ({len(data.examples)} {data.split} examples): mean attention over every "
                   "head [bootstrap 95% interval over the examples] to [CLS] "
                   f"{interval_text(heads['to_cls'].mean(), *overall['to_cls'])}, to [SEP] "
                   f"{interval_text(heads['to_sep'].mean(), *overall['to_sep'])}; per layer (1-indexed):")
        for line in layer_interval_lines(stats["special_layers"], {"to_cls": "to [CLS]", "to_sep": "to [SEP]"}):
            typer.echo(f"  {line}")
        top_tokens = stats["top_cls_tokens"]
        typer.echo(f"  last layer's [CLS] attends most to, of the tokens seen {stats['top_cls_min_count']} times or "
                   "more (all in cls_last_layer.csv) [bootstrap 95% interval over the inputs]: " + ", ".join(
            f"{row.token} ({interval_text(row.mean_attention, row.ci_low, row.ci_high)}, n={row.count})"
            for row in top_tokens.itertuples()))
        for feature, count in stats["counts"].items():
            typer.echo(f"  {feature}: {count} inputs" + (strongest_head_text(heads[feature], intervals[feature],
                                                                            stats["strongest"][feature])
                                                       if count else ""))
        for feature, why in stats["unavailable"].items():
            typer.echo(f"  {feature}: {why}")
        typer.echo(f"  tables: {run.path}/special_tokens.csv, cls_last_layer.csv, linguistic.csv")
    if len(names) > 1:
        echo_feature_change(bundle, bundles[names[1]], data, RunDir(bundle.slug, data.task, runs_dir),
                            (all_stats[names[0]], all_stats[names[1]]), unpaired)


def echo_feature_change(tuned, base, data, run: RunDir, both_stats: tuple[dict, dict], unpaired: str | None) -> None:
    """Write and print the paired change fine-tuned minus base of the attention to each feature (or why there is
    none): over every head, and at the heads each model's attention picks on the even-numbered inputs, scored on
    the odd ones. both_stats: the fine-tuned and the base model's write_special statistics."""
    if unpaired:
        typer.echo(f"no paired change {tuned.name} minus {base.name}: {unpaired}")
        return
    tuned_stats, base_stats = both_stats
    changes = write_feature_change(tuned, base, data, run, tuned_stats, base_stats)
    typer.echo(f"{tuned.name} minus {base.name}, attention to each feature on the same inputs [paired bootstrap 95% "
               "interval over the inputs that have it]:")
    for feature, change in changes.items():
        text = (f"  {feature}: over every head {interval_text(*change['model'], spec='+.3f')} "
                f"({int(change['weights'].sum())} inputs)")
        picks = {}  # head -> the models whose attention picked it on the even-numbered inputs
        for model, stats in (("fine-tuned", tuned_stats), ("base", base_stats)):
            picked = stats["strongest"][feature]["held_out"]
            if picked:
                picks.setdefault((picked["layer"], picked["head"]), []).append(model)
        for (layer, head), models in picks.items():
            held = held_out_change(change, layer, head)
            if held:
                text += (f"; at L{layer + 1}-H{head + 1} ({' and '.join(models)} head picked on the even-numbered "
                         f"inputs) {interval_text(held['mean'], held['ci_low'], held['ci_high'], spec='+.3f')} on "
                         f"the other {held['inputs']}")
        typer.echo(text)
    typer.echo(f"  per head: {run.file('linguistic_change.csv')}")
