"""The accuracy/latency front: dominance, which cut variants and ensembles are kept, and marking the rest."""

from __future__ import annotations

from collections.abc import Sequence

from engines.manifest import Ensemble, EnsembleTried, Rung


def dominates(a: Rung | Ensemble, b: Rung | Ensemble) -> bool:
    """a is at least as accurate on val and no slower (p50) at every measured batch size, and better somewhere."""
    faster = all(a.profile(p.batch).p50_ms <= p.p50_ms for p in b.profiles)
    strictly = a.val_accuracy > b.val_accuracy or any(a.profile(p.batch).p50_ms < p.p50_ms for p in b.profiles)
    return a.val_accuracy >= b.val_accuracy and faster and strictly


def mark_dominated(rungs: Sequence[Rung | Ensemble]) -> None:
    for r in rungs:
        better = [o for o in rungs if o is not r and dominates(o, r)]
        r.dominated = bool(better)
        r.dominated_by = max(better, key=lambda o: o.val_accuracy).name if better else None


def cut_candidates(fp32: list[Rung], max_drop_pp: float) -> list[Rung]:
    """Cut variants within `max_drop_pp` of the full network's val accuracy, most accurate first."""
    full = max(r.val_accuracy for r in fp32 if r.kind == "exit")
    cuts = [r for r in fp32 if r.kind == "cut" and r.val_accuracy >= full - max_drop_pp / 100]
    return sorted(cuts, key=lambda r: -r.val_accuracy)


def keep_pareto_cuts(fp32: list[Rung], min_cuts: int, max_drop_pp: float) -> tuple[list[Rung], list[str]]:
    """Keep the cut variants on the accuracy/latency front of all FP32 rungs (at least `min_cuts` of them).

    Only variants within `max_drop_pp` of the full network's val accuracy are candidates: the deepest cuts
    are the fastest of all, so they sit on the front even when they answer no better than chance.
    """
    cuts = cut_candidates(fp32, max_drop_pp)
    front = [c for c in cuts if not any(dominates(o, c) for o in fp32 if o is not c)]
    keep = front if len(front) >= min_cuts else cuts[:min_cuts]
    graphs = {r.name.split(".")[0] for r in keep}
    return [r for r in fp32 if r.kind != "cut" or r.name.split(".")[0] in graphs], sorted(graphs)


def keep_pareto_ensembles(
    rungs: list[Rung], ensembles: list[Ensemble], pruned: Sequence[EnsembleTried] = ()
) -> tuple[list[Ensemble], list[EnsembleTried]]:
    """Keep the ensembles that no rung or other ensemble dominates; mark dominance over what is kept.

    `pruned` are the sets the search dropped before timing; they are listed with the measured ones.
    """
    mark_dominated([*rungs, *ensembles])
    tried = [
        EnsembleTried(
            name=e.name,
            members=e.members,
            stacker=e.stacker,
            val_accuracy=e.val_accuracy,
            test_accuracy=e.test_accuracy,
            soft_vote_test_accuracy=e.soft_vote_test_accuracy,
            p50_ms_batch1=e.profile(1).p50_ms,
            kept=not e.dominated,
            dominated_by=e.dominated_by,
        )
        for e in ensembles
    ]
    kept = [e for e in ensembles if not e.dominated]
    mark_dominated([*rungs, *kept])  # so every dominated_by names a record in the ladder
    return kept, [*tried, *pruned]
