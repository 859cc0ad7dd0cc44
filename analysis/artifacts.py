"""Names of the files each analysis writes into runs/<model-slug>/<task>/ (the app reads these).

Tables are long CSVs (layer, head, [key], value) unless noted; figures are <stem>.png and <stem>.svg.
(`attnpat classify --maps DIR` writes DIR/map_classes.csv beside the map files: map_id, predicted, p_<class>.)
"""

ARTIFACTS: dict[str, dict[str, str]] = {
    # foundation
    "overview": {"overview": "layer, head, metric (to_cls|to_sep|entropy), value"},
    # classifier (Kovaleva Figure 2); runs/<model>/all/ holds the per-task comparison
    "classify": {
        "patterns": "layer, head, class, count, fraction  (+ patterns.png/svg: per-head class heatmap)",
        "pattern_ratios": "class, count, fraction  (+ pattern_ratios.png/svg: stacked bar)",
        "pattern_ratios_by_task": "task, class, count, fraction (in runs/<model>/all/)",
    },
    # classifier training, in runs/classifier/<labeled set>/
    "train": {
        "cv_scores": "model, metric (macro_f1|macro_f1_fold_std|accuracy|f1|macro_f1_agreed), class, value",
        "cv_confusion": "model, true, predicted, count  (+ cv_confusion.png/svg)",
        "cv_predictions": "map_id, fold, label, [annotators_agreed], <model>... (out-of-fold predicted class), "
                          "p_<class> (the CNN's)",
    },
    # fine-tuning (Kovaleva Figures 5-7, section 4.4); written under the FINE-TUNED model's run dir
    "finetune": {
        "finetune_eval": "metric, value",
        "cosine": "layer, head, metric (cosine_cropped|cosine_padded), value  (+ cosine.png/svg)",
        "special_tokens": "layer, head, metric (to_cls|to_sep), value  (+ special_tokens.png/svg)",
        "cls_last_layer": "token, mean_attention, count",
        "linguistic": "layer, head, feature (negation|noun|verb|pronoun|subject|object), value",
    },
    # disabling, importance, pruning (Kovaleva Figures 8-9, Michel et al.)
    "sweeps": {
        "disable_heads": "layer, head, metric (<mode>_delta|<mode>_metric), value  (+ disable_heads.png/svg; "
                         "resume state in .sweep-<mode>-<unit>/; best/worst heads in manifest analyses.disable_<mode>)",
        "disable_layers": "layer, mode, metric, delta  (+ disable_layers.png/svg)",
        "importance": "layer, head, metric (importance|importance_raw), value  (+ importance.png/svg)",
        "pruning": "fraction_pruned, n_pruned, metric  (+ pruning.png/svg)",
    },
    # Clark et al.
    "clark": {
        "surface": "layer, head, metric (prev|next|self|cls|sep|period|comma|sep_sep|entropy|cls_entropy), value"
                   "  (+ surface.png/svg, surface_entropy.png/svg)",
        "head_distances": "layer, head, other_layer, other_head, value (JS divergence, nats)",
        "head_labels": "layer, head, label",
        "grad_importance": "layer, target (sep|punct|other), value  (+ grad_importance.png/svg)",
        "clusters": "layer, head, x, y, behaviour  (+ clusters.png/svg)",
        "probing_dependency": "relation, direction, best_layer, best_head, accuracy, baseline_offset, baseline_accuracy,"
                              " count  (+ probing_dependency.png/svg)",
        "probing_dependency_heads": "layer, head, direction, relation, accuracy, count",
        "probing_coref": "layer, head, metric (accuracy), value  (+ baselines in probing_coref_baselines.csv)",
    },
}
