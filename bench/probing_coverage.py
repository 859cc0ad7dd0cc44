"""Coverage of probe-dep's 95% intervals by the number of sentences S that hold a relation's words, on simulated
relations whose true share is known: a share of words right (sentence_share_interval) and a head-minus-baseline
difference (sentence_difference_interval). It measured FEW_SENTENCES (analysis.probing, docs/results.md).

    .venv/bin/python bench/probing_coverage.py                 # as probe-dep computes them now
    .venv/bin/python bench/probing_coverage.py --few 1         # the sentence bootstrap alone, never widened
    .venv/bin/python bench/probing_coverage.py --pool 0        # every held-out sentence holds the relation

The relation's S sentences lie among --pool held-out sentences (the rest hold none of its words). Each holds
1-20 of its words; a sentence's own chance of a word right is drawn from a beta distribution (within-sentence
correlation 0, 0.3 or 0.9) around the true share (0.3, 0.6 or 0.85; the difference: head 0.6 vs baseline 0.45,
drawn independently). Prints, per S, the least and the mean coverage over the settings.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this checkout's analysis, not an installed one
from analysis import probing  # noqa: E402

SHARES = (0.3, 0.6, 0.85)
CORRELATIONS = (0.0, 0.3, 0.9)


def words_right(rng: np.random.Generator, share: float, correlation: float, words: np.ndarray) -> np.ndarray:
    """(S,) words right per sentence, each sentence's chance beta-distributed around ``share``."""
    if correlation:
        spread = (1 - correlation) / correlation
        chances = rng.beta(share * spread, (1 - share) * spread, len(words))
    else:
        chances = np.full(len(words), share)
    return rng.binomial(words.astype(int), chances).astype(float)


def padded(words: np.ndarray, pool: int) -> np.ndarray:
    """The relation's (S,) sentences among ``pool`` held-out sentences, the rest without its words (zeros), as
    probe-dep resamples them."""
    return np.concatenate([words, np.zeros(max(pool - len(words), 0))])


def coverage(rng: np.random.Generator, sentences: int, sims: int, pool: int) -> tuple[list[float], list[float]]:
    """Coverage of the share intervals (one per setting) and of the difference intervals (one per correlation)."""
    shares, differences = [], []
    for correlation in CORRELATIONS:
        for share in SHARES:
            hits = 0
            for _ in range(sims):
                words = rng.integers(1, 21, sentences).astype(float)
                right = padded(words_right(rng, share, correlation, words), pool)
                low, high = probing.sentence_share_interval(right[:, None], padded(words, pool))[0]
                hits += low <= share <= high
            shares.append(hits / sims)
        hits = 0
        for _ in range(sims):
            words = rng.integers(1, 21, sentences).astype(float)
            head = padded(words_right(rng, 0.6, correlation, words), pool)
            baseline = padded(words_right(rng, 0.45, correlation, words), pool)
            words = padded(words, pool)
            head_interval, baseline_interval = probing.sentence_share_interval(np.stack([head, baseline], 1), words)
            low, high = probing.sentence_difference_interval(head, baseline, words, head_interval, baseline_interval)
            hits += low <= 0.15 <= high
        differences.append(hits / sims)
    return shares, differences


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sims", type=int, default=1000, help="simulated relations per setting and S")
    parser.add_argument("--few", type=int, default=probing.FEW_SENTENCES,
                        help="FEW_SENTENCES to use (1: the bootstrap alone, as before it was widened)")
    parser.add_argument("--sentences", type=int, nargs="+", default=[3, 5, 10, 15, 20, 30])
    parser.add_argument("--pool", type=int, default=250, help="held-out sentences in all, most without the relation "
                                                              "(250: probe-dep --parse wiki --n 500)")
    args = parser.parse_args(argv)
    if args.sims < 1 or args.few < 1 or min(args.sentences) < 2:
        parser.error("--sims and --few must be at least 1, --sentences at least 2")
    probing.FEW_SENTENCES = args.few
    rng = np.random.default_rng(4)
    for sentences in args.sentences:
        shares, differences = coverage(rng, sentences, args.sims, args.pool)
        print(f"S={sentences:>2}: share coverage min {min(shares):.3f} mean {np.mean(shares):.3f}; "
              f"difference coverage min {min(differences):.3f} mean {np.mean(differences):.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
