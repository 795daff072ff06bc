"""The table people look at after a build: every rung, ensemble and cascade, with the Pareto front marked.

Rungs and ensembles show their measured batch-1 p50 and p99; stage cascades their expected mean (exit shares
on val times stage p50s); member cascades their mean and p99 measured end to end over the test split.
"""

from __future__ import annotations

from engines.manifest import Ensemble, Ladder, MemberCascade, Rung

FRONT = "*"  # on the accuracy/latency front: no other rung or ensemble is as accurate and no slower


def _row(r: Rung | Ensemble, note: str) -> str:
    b1, b32 = r.profile(1), r.profile(32)
    front = " " if r.dominated else FRONT
    return (
        f"{front} {r.name:<34} {r.val_accuracy:>7.2%} {r.test_accuracy:>7.2%} {b1.p50_ms:>10.3f} "
        f"{b1.p99_ms:>8.3f} {b32.p50_ms:>8.3f} {r.artifact.bytes / 1e6:>6.2f}  {note}"
    )


def ladder_table(ladder: Ladder) -> str:
    """One line per rung, ensemble and cascade: accuracy and measured latency; `*` marks the front."""
    lines = [f"  {'rung':<34} {'val':>7} {'test':>7} {'p50 b1 ms':>10} {'p99 b1':>8} {'p50 b32':>8} {'MB':>6}  note"]
    for r in ladder.rungs:
        lines.append(_row(r, f"dominated by {r.dominated_by}" if r.dominated else ""))
    for e in ladder.ensembles:
        note = f"{e.stacker}, soft vote {e.soft_vote_test_accuracy:.2%}"
        lines.append(_row(e, note + (f", dominated by {e.dominated_by}" if e.dominated else "")))
    for c in ladder.cascades:
        shares = "/".join(f"{s:.2f}" for s in c.expected_exit_share)
        lines.append(
            f"  {c.name:<34} {c.val_accuracy:>7.2%} {c.test_accuracy:>7.2%} {c.expected_mean_ms:>10.3f} "
            f"{'':>8} {'':>8} {'':>6}  exit shares {shares}, last exit {c.test_last_exit_accuracy:.2%}"
        )
    for m in ladder.member_cascades:
        shares = "/".join(f"{s:.2f}" for s in m.test_exit_share)
        mark = " " if m.dominated else FRONT
        lines.append(
            f"{mark} {m.name:<34} {m.val_accuracy:>7.2%} {m.test_accuracy:>7.2%} {m.test_mean_ms:>10.3f} "
            f"{m.test_p99_ms:>8.3f} {'':>8} {'':>6}  measured mean on test; answered after each member {shares}"
            + (f", dominated by {m.dominated_by}" if m.dominated else "")
        )
    options: list[Rung | Ensemble | MemberCascade] = [*ladder.rungs, *ladder.ensembles, *ladder.member_cascades]
    front = sum(not o.dominated for o in options)
    lines.append(
        f"{FRONT} on the accuracy/latency front ({front} of {len(options)} rungs, ensembles and member cascades; "
        "a member cascade by its measured mean)"
    )
    if ladder.probe is not None:
        for precision, reason in ladder.probe.reasons.items():
            verdict = "built" if precision in ladder.probe.built else "not built"
            lines.append(f"probe ({ladder.probe.graph}): {precision} {verdict}: {reason}")
    return "\n".join(lines)


def summary(ladder: Ladder, out: str) -> str:
    """The one line that says what was written."""
    tried = len(ladder.ensemble_search)
    return (
        f"wrote {out}/ladder.json: {len(ladder.rungs)} rungs, {len(ladder.stages)} stages, "
        f"{len(ladder.cascades)} cascades, {len(ladder.ensembles)} ensembles ({tried} sets tried), "
        f"{len(ladder.member_cascades)} member cascades "
        f"in {ladder.build_seconds:.0f} s ({ladder.build_steps.get('ran', 0):.0f} steps run, "
        f"{ladder.build_steps.get('skipped', 0):.0f} cached)"
    )
