"""The report of ``bench/memory.py``'s rows: the markdown table (GiB per rank and bytes per local parameter),
where the optimizers' bytes are allocated, and the page around them (``memory.py --report-only`` rebuilds it
from the JSON)."""
from __future__ import annotations

COLUMNS = ("params", "grads", "state", "kept", "transient", "fwd_bw", "peak", "host")
"""The byte columns of a row (``bytes`` in the JSON), in the table's order."""
DEVICE = "cpu (FakeTensorMode)"


def _gib(n) -> str:
    return f"{n / 2**30:.2f}" if abs(n) >= 2**30 / 100 else f"{n / 2**20:.1f} Mi"


def table(rows: list[dict]) -> str:
    """The markdown table of ``rows``: GiB per rank (``Mi``: MiB), then bytes per local parameter."""
    head = ("| size | setup | W (R x S) | voters | local params | params | grads | state | kept | transient | "
            "fwd/bw | peak | host | B/param: state, kept, transient, peak(, host) |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        shape = f"{r['world']} ({r['replicas']} x {r['shards']})"
        name = r["optimizer"] + ("" if r.get("fused") in (None, "stub") else f" (fused={r['fused']})")
        if r.get("error"):
            out.append(f"| {r['size']} | {name} | {shape} | | | | | | | | | | | error at {r.get('raised_at')}: "
                       f"{r['error'][:160]} |")
            continue
        b, pp = r["bytes"], r["per_param"]
        cells = " | ".join("" if k == "host" and not b.get(k) else _gib(b[k]) for k in COLUMNS)  # (none: no host)
        host = f", {pp['host']:.2f}" if b.get("host") else ""
        out.append(f"| {r['size']} | {name} | {shape} | {r.get('voters') or ''} | {r['local_params'] / 1e6:,.1f}M | "
                   f"{cells} | {pp['state']:.2f}, {pp['kept']:.2f}, {pp['transient']:.2f}, {pp['peak']:.2f}{host} |")
    return "\n".join(out) + "\n"


def sites(rows: list[dict], top: int = 4) -> str:
    """Per setup, at its largest size: the lines that hold the optimizer's bytes after the step and at the
    step's peak (``file:line``, bytes per local parameter: the ``kept_at`` and ``transient_at`` of the JSON)."""
    largest: dict[str, dict] = {}
    for r in rows:
        if not r.get("error") and r["params"] > largest.get(r["optimizer"], {}).get("params", -1):
            largest[r["optimizer"]] = r
    if not largest:
        return ""
    out = ["Where the optimizer's bytes are allocated, per setup at its largest size: GiB (Mi: MiB) and, in "
           "brackets, bytes per local parameter, of each line holding over 1 MiB:\n",
           "| setup | size (W) | held after the step (state + kept) | at the step's peak (transient) |",
           "|---|---|---|---|"]
    for name, r in largest.items():
        n = r["local_params"]

        def fmt(by_site):
            return ", ".join(f"{k} {_gib(v)} ({v / n:.2f})" for k, v in list(by_site.items())[:top]) or "-"
        out.append(f"| {name} | {r['size']} ({r['world']}) | {fmt(r['kept_at'])} | {fmt(r['transient_at'])} |")
        if r.get("round_transient") is not None:
            out.append(f"| {name}: the round alone | {r['size']} ({r['world']}) | | {_gib(r['round_transient'])} "
                       f"({r['round_transient'] / n:.2f}) in all: {fmt(r['round_at'])} |")
    return "\n".join(out) + "\n"


def report(rows: list[dict]) -> str:
    """The markdown report: what was measured and how, the table, where the optimizers' bytes go."""
    first = rows[0] if rows else {}
    trees = sorted({(r.get("source") or {}).get("commit") or "?" for r in rows})
    changed = sorted({f for r in rows for f in (r.get("source") or {}).get("changed", [])})
    cpu = sum(r.get("cpu_s", 0) for r in rows)
    return (f"# Memory per rank of one training step ({DEVICE})\n\n"
            "`bench/memory.py` (its docstring says how): GiB per rank (Mi: MiB) on rank 0 of W fake ranks, "
            f"GPT shapes with tied embeddings, {first.get('dtype', 'float32')} parameters unless a setup says bf16, "
            f"batch {first.get('batch')} x {first.get('seq')} tokens; the last of 2 steps measured (LocalCub: the "
            "step that ends a round). state: the optimizer's `state`; kept: what else stays allocated after the "
            "step; transient: the peak during `opt.step()` minus what was allocated before it; fwd/bw: the same "
            "for forward + backward (the gradients included); peak: the highest total of the measured step; host: "
            "what the optimizer keeps in host memory (`outer_state='host'`), in no other column. "
            "LionCub's fused loops run as no-op stand-ins (their buffers are torch allocations) unless a row says "
            f"fused=off. Source: commit {', '.join(trees)}"
            + (f" with uncommitted changes in {', '.join(changed)}" if changed else "")
            + f"; {cpu / 60:.1f} min of CPU for these rows.\n\n" + table(rows) + "\n" + sites(rows))


