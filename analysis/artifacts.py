"""The one registry of what the analyses write: verb -> files -> app tab, and the command that writes them.

Every analysis writes into runs/<model-slug>/<task>/ (``folder`` names a fixed task folder instead, e.g.
runs/<model>/all/). Tables are long CSVs (layer, head, [key], value) unless ``columns`` says otherwise;
an artifact with ``figure`` also has <stem>.png and <stem>.svg. The web app builds its run tabs, their
"not computed yet" hints and its download lists from this table alone; a test runs the analyses on a tiny
model and checks that every file they write is listed here.
(`attnpat classify --maps DIR` writes DIR/map_classes.csv beside the map files: map_id, predicted, p_<class>.)
"""
from __future__ import annotations

import shlex
from dataclasses import dataclass
from fnmatch import fnmatch

# Map kinds (analysis.mapkinds) other than the attention weights get run folders of their own beside the
# model's, holding the same files: runs/<model>@<kind>/<task>/ (e.g. runs/minilm@norm/sst2/). The verbs that
# take --map-kind:
KIND_SEPARATOR = "@"
MAP_KIND_VERBS = ("extract", "classify", "special", "surface")

# Placeholders of a hint: the run tab's model (run-directory name) and task, and {base}: the base model the run's
# model was fine-tuned from (DEFAULT_BASE when none is recorded). A verb without --map-kind writes only the weight
# run folder, so a <model>@<kind> run never holds its artifacts and hints none (Artifact.written_in).
STANDARD = "--model {model} --task {task}"
DEFAULT_BASE = "minilm"  # the embedded model, the base the fine-tuning hints start from
# The labeled set that ships with the repository (the hint for the Classifier tab names it).
SHIPPED_LABELED_SET = "annotation/labeled/v5"
# The held-out panel's labels, which no checkpoint is trained on (the hint of `attnpat evaluate` names it).
HELD_OUT_LABELED_SET = "annotation/labeled/panel-4"


@dataclass(frozen=True)
class Tab:
    """One run tab of the web app: its title, the sentence it opens with, the task it prefers, and the one run
    folder (model) it reads when its results are not per encoder (the classifier's training runs)."""

    name: str
    intro: str
    preferred_task: str = "sst2"
    model: str | None = None

    @property
    def key(self) -> str:
        """The tab's id in the page and its endpoint name (lower case, dashes)."""
        return self.name.lower().replace(" ", "-")


@dataclass(frozen=True)
class Artifact:
    """One result of an analysis: <stem>.csv (when ``table``), <stem>.png/.svg (when ``figure``).

    verb: the `attnpat` verb that writes it; tab: the app tab that shows it (None: not shown, e.g. the map
    shards); hint: the verb's arguments, with {model}, {task} and {base} filled in by the tab; folder: a fixed
    task folder that holds it whatever task is picked; kind: "dir" for a folder (its stem may be a glob pattern),
    "checkpoint" for <stem>.safetensors with its <stem>.json metadata, "json" for <stem>.json; finetuned: written
    only in a fine-tuned model's run (it pairs the model with its base), so the app does not hint it for the run
    of a model that has no base recorded.
    """

    stem: str
    verb: str
    columns: str
    tab: str | None
    figure: bool = False
    table: bool = True
    folder: str | None = None
    hint: str = STANDARD
    kind: str = "file"
    finetuned: bool = False

    def files(self) -> tuple[str, ...]:
        """The file names this artifact puts in its run folder."""
        if self.kind == "dir":
            return (self.stem,)
        if self.kind == "checkpoint":
            return (f"{self.stem}.safetensors", f"{self.stem}.json")
        if self.kind == "json":
            return (f"{self.stem}.json",)
        return ((f"{self.stem}.csv",) if self.table else ()) + ((f"{self.stem}.png", f"{self.stem}.svg")
                                                                   if self.figure else ())

    def written_in(self, kind: str) -> bool:
        """Whether this artifact can be in a run folder of map kind ``kind``: weight folders hold every artifact,
        a <model>@<kind> folder only those of the verbs that take --map-kind."""
        return kind == "weight" or self.verb in MAP_KIND_VERBS

    def command(self, model: str, task: str, model_name: str | None = None, base: str | None = None) -> str:
        """The full command that writes this artifact, e.g. ``attnpat special --model minilm --task sst2``;
        ``model`` is a run-folder name, so minilm@norm gives ``--model minilm ... --map-kind norm``.
        ``model_name``: the model as the user named it (a run's manifest records it), which the folder's name
        cannot give back for a hub id ('org/model' -> folder org__model) or a name with '@' (-> '_at_').
        ``base``: the base model the run's model was fine-tuned from, for {base} (default DEFAULT_BASE)."""
        model, kind = split_kind_folder(model) if model else (model, "weight")  # no run picked yet: None
        if model_name:
            model = shlex.quote(model_name)  # a path may hold spaces
        extra = f" --map-kind {kind}" if kind != "weight" and self.verb in MAP_KIND_VERBS else ""
        arguments = self.hint.format(model=model, task=task, base=shlex.quote(base or DEFAULT_BASE))
        return f"attnpat {self.verb} {arguments}".rstrip() + extra


TABS: tuple[Tab, ...] = (
    Tab("Pattern ratios", "How often each head's maps fall into the five attention patterns (vertical, diagonal, "
        "vertical+diagonal, block, heterogeneous), as the pattern CNN classifies them; reproduces Kovaleva et al. "
        "2019 Fig. 2."),
    Tab("Fine-tuning", "How attention changes when the model is fine-tuned: per-head cosine similarity to the base "
        "model, attention to [CLS] and [SEP], the last layer's [CLS] row and attention to linguistic features; "
        "reproduces Kovaleva et al. 2019 Fig. 5-7 and section 4.4."),
    Tab("Disabling", "The task metric with single heads or whole layers disabled, head importance and the pruning "
        "curve; reproduces Kovaleva et al. 2019 Fig. 8-9 and Michel et al. 2019 (importance, pruning)."),
    Tab("Surface and clusters", "What each head attends to (previous, next, [CLS], [SEP], punctuation), how broadly, "
        "how heads cluster and which heads track syntax and coreference; reproduces Clark et al. 2019 Fig. 2, 4, 5, "
        "6 and Tables 1-2.", preferred_task="wiki"),
    Tab("Classifier", "How well the pattern CNN classifies labeled maps: cross-validated scores against the "
        "baselines, per-class F1 and the confusion matrix; the classifier behind Kovaleva et al. 2019 Fig. 2.",
        preferred_task="v2", model="classifier"),
)

_TRAIN = f"--data {SHIPPED_LABELED_SET}"
_EVALUATE = f"--data {HELD_OUT_LABELED_SET}"
# classifier.evaluate.baseline_comparison, written by train (out-of-fold) and evaluate (held out) alike
_VS_BASELINES = ("model, reference_macro_f1 (the CNN's), model_macro_f1, difference, ci_low, ci_high (95% paired "
                 "bootstrap over maps), p_value (paired permutation test), p_holm (Holm across the baselines), "
                 "verdict (above|below|level: above or below when the interval excludes 0 and p_holm < 0.05)")
# the interval columns of the per-head (per-layer) means of overview, special, surface and grad-importance
_OVER_EXAMPLES = "ci_low, ci_high (percentile bootstrap 95% interval over the examples)"
# The uncorrected p of a disabling or pruning table, named by its test (analysis.sweeps.raw_p_column)
_RAW_P = ("<raw p>: p_mcnemar, exact McNemar test of per-example correctness, on accuracy tasks (empty for "
          "correlation metrics: no test); p_permutation, paired permutation test of the F1 or Matthews change, "
          "on those tasks; p_holm: Holm across the heads, layers or pruning steps")
# analysis.surface.label_evidence: what decided each head's label, and whether its intervals settle it
_LABEL_EVIDENCE = ("statistic (the rule's: prev|next|entropy|cls|sep|punct; empty for other), value, ci_low, ci_high "
                   "(95% bootstrap over the examples), threshold, certain (the same label anywhere in the intervals)")
# classifier.classify.ratio_table: a task's class ratios three ways, each share with its interval
_RATIOS = ("class, count, fraction (as classified), ci_low, ci_high (95% bootstrap over the examples), adjusted (for "
           "the classifier's cross-validated confusion matrix, projected onto the simplex), adjusted_ci_low, "
           "adjusted_ci_high (95% bootstrap over the examples and the confusion matrix's labeled maps, of the "
           "unprojected solutions cut to [0, 1])")
_PARSE = "--parse {task} --model {model}"  # silver parses of the task's sentences (a CoNLL-U file gives gold ones)

ARTIFACTS: tuple[Artifact, ...] = (
    # Pattern ratios (Kovaleva Figure 2); runs/<model>/all/ holds the per-task comparison
    Artifact("pattern_ratios_by_task", "classify", f"task, {_RATIOS}  (grouped bars per task with the intervals)",
             "Pattern ratios", figure=True, folder="all", hint="--model {model} --task all"),
    Artifact("pattern_ratios", "classify", f"{_RATIOS}  (bars with the intervals)", "Pattern ratios", figure=True),
    Artifact("patterns", "classify", "layer, head, class, count, fraction, ci_low, ci_high (Wilson 95% interval over "
             "the examples)  (per-head class heatmap)", "Pattern ratios", figure=True),
    # each example's maps per class: what a paired comparison of two classifications (compare-kinds) resamples
    Artifact("example_patterns", "classify", "index (position in the data), example_id, <class>... (the example's "
             "maps in each class, summed over its heads)", None),
    # Weight against norm maps (Kobayashi et al. 2020), in the weight run folder; each kind's own classification
    # lands in runs/<model>@<kind>/<task>/
    Artifact("map_kinds", "compare-kinds", "task, group (pattern_ratio|attention), measure (<class>|to_cls|to_sep|"
             "to_punct), layer (all|0..L-1), <kind>... (per kind <kind>, <kind>_ci_low, <kind>_ci_high: weight, norm "
             "with rows renormalised; the ratios' intervals from each kind's pattern_ratios.csv, the attention's a "
             "percentile bootstrap 95% over the examples), [norm_minus_weight] (with weight and norm), "
             "[norm_minus_weight_ci_low], [norm_minus_weight_ci_high] (paired bootstrap 95%: the same example draws "
             "for both kinds)  (per-layer lines and ratio bars with error bars)", "Pattern ratios", figure=True),
    # Fine-tuning (Kovaleva Figures 5-7, section 4.4); written under the FINE-TUNED model's run dir
    Artifact("cosine", "compare", "layer, head, metric (cosine_<mode>, cosine_<mode>_ci_low|_ci_high: bootstrap "
             "95% over the examples; mode cropped|padded), value", "Fine-tuning",
             figure=True, hint="--base {base} --finetuned {model} --task {task}", finetuned=True),
    Artifact("pattern_transitions", "compare", "base_class, finetuned_class, count, fraction, fraction_ci_low, "
             "fraction_ci_high, fraction_of_base, fraction_of_base_ci_low, fraction_of_base_ci_high  (pattern class "
             "of every head's map, base -> fine-tuned, same examples; bootstrap 95% over the examples)", "Fine-tuning",
             figure=True, hint="--base {base} --finetuned {model} --task {task}", finetuned=True),
    Artifact("special_tokens", "special", f"layer, head, metric (to_cls|to_sep), value, {_OVER_EXAMPLES}",
             "Fine-tuning", figure=True),
    Artifact("finetune_eval", "finetune", "metric (the task's metric and accuracy/F1 or Pearson/Spearman, each "
             "with <metric>_ci_low|_ci_high: 95% interval, Wilson for accuracy, bootstrap over the examples "
             "otherwise; n_eval, steps, elapsed_seconds), value", "Fine-tuning",
             hint="--model {base} --task {task} --split-dev --name {model}", finetuned=True),
    Artifact("cls_last_layer", "special", "token, mean_attention (over its occurrences), ci_low, ci_high (percentile "
             "bootstrap 95% interval resampling the inputs; none for a token of one input), count, inputs",
             "Fine-tuning"),
    Artifact("linguistic", "special", "layer, head, feature (negation|noun|verb|pronoun|subject|object), value, "
             "ci_low, ci_high (percentile bootstrap 95% interval over the inputs that have the feature)",
             "Fine-tuning"),
    Artifact("linguistic_change", "special", "layer, head, feature (negation|noun|verb|pronoun|subject|object), value "
             "(fine-tuned minus base, per input), ci_low, ci_high (paired percentile bootstrap 95% interval over the "
             "inputs that have the feature for both models), inputs  (in the fine-tuned model's run, when special "
             "also analyses its base; removed when special runs without it)", "Fine-tuning",
             hint="--model {model} --base {base} --task {task}", finetuned=True),
    # Disabling, importance, pruning (Kovaleva Figures 8-9, Michel et al.)
    Artifact("disable_heads", "disable", "layer, head, metric (<mode>_delta|<mode>_metric|<mode>_delta_ci_low|"
             "<mode>_delta_ci_high|<mode>_<raw p>|<mode>_p_holm), value  (best/worst heads and those that "
             f"survive Holm in manifest analyses.disable_<mode>; {_RAW_P})", "Disabling", figure=True),
    Artifact("disable_layers", "disable", f"layer, mode, metric, delta, ci_low, ci_high, <raw p>, p_holm  ({_RAW_P})",
             "Disabling", figure=True),
    Artifact("importance", "importance", "layer, head, metric (importance|importance_raw|importance_raw_ci_low|"
             "importance_raw_ci_high: percentile bootstrap 95% interval over the examples), value", "Disabling",
             figure=True),
    Artifact("pruning", "prune", "fraction_pruned, n_pruned, metric, delta, ci_low, ci_high, <raw p>, p_holm, "
             "ranked_on, n_ranked, scored_on, n_scored (heads ranked on the even-numbered examples, every other "
             f"column scored on the odd-numbered ones; {_RAW_P})", "Disabling", figure=True),
    # Clark et al.
    Artifact("surface", "surface", "layer, head, metric (prev|next|self|cls|sep|period|comma|sep_sep: shares of "
             "attention; entropy|cls_entropy: nats; token level, each input weighed equally), value, "
             f"{_OVER_EXAMPLES}", "Surface and clusters", figure=True),
    Artifact("surface_entropy", "surface", "(figure only: mean and [CLS]-row entropy per head)",
             "Surface and clusters", figure=True, table=False),
    Artifact("overview", "overview", f"layer, head, metric (to_cls|to_sep|entropy), value, {_OVER_EXAMPLES}",
             "Surface and clusters"),
    Artifact("head_labels", "surface", f"layer, head, label, {_LABEL_EVIDENCE}", "Surface and clusters"),
    Artifact("clusters", "cluster", "layer, head, x, y, position_radius (95th percentile of the distance from x, y "
             f"over 100 bootstrap draws, Procrustes-aligned MDS refits), behaviour, {_LABEL_EVIDENCE}",
             "Surface and clusters",
             figure=True),
    Artifact("head_distances", "cluster", "layer, head, other_layer, other_head, value (JS divergence, nats: mean over "
             "each input's real query rows, [CLS] and [SEP] included, then over the inputs), "
             f"{_OVER_EXAMPLES}",
             "Surface and clusters"),
    Artifact("grad_importance", "grad-importance", "layer, target (sep|punct|other: the key's token in the "
             "input the model sees), value (mean |d loss / d attention weight| over the layer's heads, real query "
             f"rows and keys of the target, the weights of all examples pooled), {_OVER_EXAMPLES}",
             "Surface and clusters", figure=True),
    Artifact("probing_dependency", "probe-dep", "relation ((all): every scored word; else a DEPREL), "
             "direction (dep->head: the word attends to its head; head->dep: the head attends to the word), "
             "best_layer, best_head (picked on the even-numbered sentences), accuracy (on silver parses: agreement "
             "with spaCy's parser), ci_low, ci_high (on the odd-numbered ones; intervals resample whole sentences, "
             "widened below 20), baseline_offset, baseline_accuracy, "
             "baseline_ci_low, baseline_ci_high, head_minus_baseline, head_minus_baseline_ci_low, "
             "head_minus_baseline_ci_high (paired sentence-level bootstrap), p_value (paired sign-flip test over the "
             "held-out sentences, head vs offset), p_holm (Holm across the table's rows), held_out_count (words), "
             "held_out_sentences (holding the relation), "
             "count, in_sample_accuracy (Clark's: picked and scored on all), parses (gold or silver, and from what)",
             "Surface and clusters", figure=True, hint=_PARSE),
    Artifact("probing_dependency_heads", "probe-dep", "layer, head, direction, relation ((all)|a DEPREL), "
             "accuracy, ci_low, ci_high (resampling whole sentences), count, parses", "Surface and clusters",
             hint=_PARSE),
    Artifact("probing_coref", "probe-coref", "layer, head, metric (accuracy|accuracy_ci_low|accuracy_ci_high: "
             "Wilson, each sentence one trial), value", "Surface and clusters",
             figure=True, folder="winobias", hint="--model {model}"),
    Artifact("probing_coref_baselines", "probe-coref", "baseline, accuracy, ci_low, ci_high (Wilson)",
             "Surface and clusters", folder="winobias", hint="--model {model}"),
    Artifact("probing_coref_table", "probe-coref", "model (each baseline, then the head picked on the even-numbered "
             "sentences), accuracy, ci_low, ci_high, count (on the odd-numbered ones), p_value (McNemar vs the head), "
             "p_holm (Holm across the baselines)",
             "Surface and clusters", folder="winobias", hint="--model {model}"),
    # Classifier training, in runs/classifier/<labeled set>/
    Artifact("cv_scores", "train", "model, metric (macro_f1|macro_f1_fold_std|accuracy|f1|macro_f1_agreed), class, "
             "value, ci_low, ci_high (95% bootstrap over the labeled maps, resampled within their true class from the "
             "out-of-fold confusion matrix; none for macro_f1_fold_std)", "Classifier", hint=_TRAIN),
    Artifact("cv_confusion", "train", "model, true, predicted, count", "Classifier", figure=True, hint=_TRAIN),
    Artifact("cv_predictions", "train", "map_id, fold, label, [annotators_agreed], <model>... (out-of-fold "
             "predicted class), p_<class> (the CNN's)", "Classifier", hint=_TRAIN),
    Artifact("cv_vs_baselines", "train", _VS_BASELINES, "Classifier", hint=_TRAIN),
    # Files that no tab shows
    # The classifier against a labeled set, in runs/classifier/<labeled set>/ (`attnpat evaluate`)
    Artifact("evaluation_scores", "evaluate", "metric (macro_f1|accuracy|precision|recall|f1|support), class, value, "
             "low, high (95% bootstrap interval over maps)", None, hint=_EVALUATE),
    Artifact("evaluation_confusion", "evaluate", "true, predicted, count", None, figure=True, hint=_EVALUATE),
    Artifact("evaluation_predictions", "evaluate", "map_id, label, predicted, p_<class>", None, hint=_EVALUATE),
    Artifact("evaluation_vs_baselines", "evaluate", _VS_BASELINES, None, hint=_EVALUATE),
    Artifact("evaluation_panel_size", "evaluate", "panel_size, quantile (0.05-0.95), macro_f1  (a fresh panel of that "
             "many maps, drawn as the labeled set's were: --panel-size)", None, hint=_EVALUATE + " --panel-size 270"),
    Artifact("evaluation_paired", "evaluate", "metric (accuracy|macro_f1), value, paired_value, difference, ci_low, "
             "ci_high (against --data's labels minus against --paired-with's, same maps; 95% paired bootstrap)", None,
             hint="--data annotation/labeled/panel-5 --paired-with annotation/labeled/panel-5-images-only"),
    Artifact("evaluation_annotator_pairs", "evaluate", "annotator_a, annotator_b, maps, macro_f1, macro_f1_low, "
             "macro_f1_high, agreement, agreement_low, agreement_high, kappa, kappa_low, kappa_high (Cohen's; each "
             "pair of annotators against each other, first-round labels; 95% bootstrap)", None, hint=_EVALUATE),
    Artifact("classifier", "train", "the trained CNN: classifier.safetensors and its metadata classifier.json",
             None, hint=_TRAIN, kind="checkpoint"),
    Artifact("maps", "extract", "map shards (float16 .npz per example batch; resumable)", None, kind="dir"),
    Artifact(".sweep-*", "disable", "resume state of a disabling sweep: .sweep-<mode>-<unit>/", None, kind="dir"),
    Artifact(".importance", "importance", "resume state of importance: each batch's per-example gradients", None,
             kind="dir"),
    Artifact(".clusters", "cluster", "resume state of cluster: each batch's per-example head-pair JS divergences",
             None, kind="dir"),
    Artifact(".prune-*", "prune", "resume state of a pruning curve: .prune-rank-<mode>/ (each ranking's per-batch "
             "gradients), .prune-curve-<mode>/ (each step's predictions)", None, kind="dir"),
    Artifact(".disable-inputs", "disable", "what each disabling mode's rows of disable_heads / disable_layers were "
             "computed on: {mode: {unit: model, revision, data, max_length}}", None, kind="json"),
)

def kind_folder(model_slug: str, kind: str) -> str:
    """The run-folder name of a model's maps of one kind: the slug itself for weights, <slug>@<kind> else."""
    return model_slug if kind == "weight" else f"{model_slug}{KIND_SEPARATOR}{kind}"


def split_kind_folder(folder: str) -> tuple[str, str]:
    """Inverse of :func:`kind_folder`: 'minilm@norm' -> ('minilm', 'norm'); 'minilm' -> ('minilm', 'weight')."""
    model, separator, kind = folder.rpartition(KIND_SEPARATOR)
    return (model, kind) if separator and model else (folder, "weight")


def tab(name: str) -> Tab:
    return next(entry for entry in TABS if entry.name == name)


def tab_artifacts(name: str) -> tuple[Artifact, ...]:
    """The artifacts a run tab shows, in order."""
    return tuple(artifact for artifact in ARTIFACTS if artifact.tab == name)


def artifact(stem: str) -> Artifact:
    return next(entry for entry in ARTIFACTS if entry.stem == stem)


def verbs() -> set[str]:
    """Every verb that writes an artifact."""
    return {entry.verb for entry in ARTIFACTS}


def hints(stems, model: str, task: str, model_name: str | None = None, base: str | None = None) -> list[str]:
    """The distinct commands that would write ``stems`` into run folder ``model``, in order (``model_name``,
    ``base``: see :meth:`Artifact.command`); none for a stem that folder cannot hold (:func:`weight_only`)."""
    left_out = set(weight_only(stems, model))
    return list(dict.fromkeys(artifact(stem).command(model, task, model_name, base) for stem in stems
                              if stem not in left_out))


def weight_only(stems, model: str | None) -> list[str]:
    """Those of ``stems`` that run folder ``model`` cannot hold: on a <model>@<kind> folder, the artifacts of verbs
    without --map-kind (they are written in the weight run folder <model> only); none on a weight folder."""
    kind = split_kind_folder(model)[1] if model else "weight"
    return [stem for stem in stems if not artifact(stem).written_in(kind)]


def listed(name: str) -> bool:
    """Whether a file or folder name found in a run folder is one the registry names (manifest.json included)."""
    return name == "manifest.json" or any(fnmatch(name, pattern) for entry in ARTIFACTS for pattern in entry.files())
