"""What ``bench`` prints: the tables, the markdown of saved runs, the plot."""

from .cases import OVERHEAD_SHAPE


def format_table(results):
    split = "launch_ms" in results[0]["forward"]
    head = (f"{'case':<52}{'op':<9}{'ms':>9}{'GB/s':>8}{'copy':>7}{'% copy':>8}"
            f"{'torch ms':>10}{'x torch':>9}"
            + (f"{'launch ms':>11}{'% copy':>8}" if split else ""))
    lines = [head, "-" * len(head)]
    for r in results:
        for op in ("forward", "backward"):
            m = r[op]
            torch_cols = (f"{m['torch_ms']:>10.2f}{m['speedup']:>8.1f}x" if "torch_ms" in m
                          else f"{'-':>10}{'-':>9}")
            launch = (f"{m['launch_ms']:>11.3f}{m['launch_pct_copy']:>7.0f}%" if split
                      else "")
            lines.append(f"{r['label'] if op == 'forward' else '':<52}{op:<9}"
                         f"{m['ms']:>9.3f}{m['gbs']:>8.1f}{r['copy_gbs']:>7.1f}"
                         f"{m['pct_copy']:>7.0f}%{torch_cols}{launch}")
    return "\n".join(lines)


def format_input_reads(results):
    """``--read``'s second table: per case, a parallel read of its own input and the
    forward's time against it (the call, and its launches alone with --split)."""
    lines = [f"{'case (forward against reading its input once)':<52}{'read GB/s':>10}"
             f"{'% of read':>11}{'launch':>8}"]
    for r in results:
        m = r["forward"]
        if "pct_input_read" not in m:
            lines.append(f"{r['label']:<52}{'-':>10}   (input not C-contiguous)")
            continue
        launch = f"{m['launch_pct_input_read']:>7.0f}%" if "launch_pct_input_read" in m else ""
        lines.append(f"{r['label']:<52}{r['input_read_gbs']:>10.1f}"
                     f"{m['pct_input_read']:>10.0f}%{launch}")
    return "\n".join(lines)


def markdown_table(runs):
    """One markdown table of ``bench --json`` runs (dicts as saved): a row per case and
    op, each run's ms, % of copy (and of its launches alone, if run with --split) and
    x torch side by side, headed by its thread count."""
    split = ["launch_ms" in run["results"][0]["forward"] for run in runs]
    head = ["case", "op"]
    for run, launches in zip(runs, split):
        head += [f"{run['threads']} thr: ms", "% copy"] + (["launch % copy"] if launches
                                                           else []) + ["x torch"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    labels = [r["label"] for r in runs[0]["results"]]
    for label in labels:
        for op in ("forward", "backward"):
            row = [label if op == "forward" else "", op]
            for run, launches in zip(runs, split):
                m = next((r[op] for r in run["results"] if r["label"] == label), None)
                if m is None:
                    row += ["-"] * (4 if launches else 3)
                    continue
                row += [f"{m['ms']:.2f}", f"{m['pct_copy']:.0f}%"]
                row += [f"{m['launch_pct_copy']:.0f}%"] if launches else []
                row += [f"{m['speedup']:.0f}x" if "speedup" in m else "-"]
            lines.append("| " + " | ".join(row) + " |")
    copies = ", ".join(f"{run['threads']} thread(s) "
                       f"{min(r['copy_gbs'] for r in run['results']):.1f}-"
                       f"{max(r['copy_gbs'] for r in run['results']):.1f} GB/s"
                       for run in runs)
    return "\n".join(lines) + f"\n\nCopy bandwidth in the same rounds: {copies}."


def format_overhead(us):
    """The ``--overhead`` table: each call, and what the torch function adds to the
    NumPy call beyond the empty custom op."""
    empty = us["empty custom op"]
    lines = [f"{'call':<22}{'us':>8}   (T, N, D, l, d) = {OVERHEAD_SHAPE}, float32",
             f"{'empty custom op':<22}{empty:>8.1f}"]
    for op in ("forward", "backward"):
        numpy_us, torch_us = us[f"{op}, NumPy"], us[f"{op}, torch"]
        lines.append(f"{op + ', NumPy':<22}{numpy_us:>8.1f}")
        lines.append(f"{op + ', torch':<22}{torch_us:>8.1f}   torch - NumPy = "
                     f"{torch_us - numpy_us:.1f} us, {torch_us - numpy_us - empty:+.1f} us "
                     f"beyond the empty custom op")
    numpy_us, torch_us = us["decoding, NumPy"], us["decoding, torch"]
    lines.append(f"{'decoding, NumPy':<22}{numpy_us:>8.1f}   (--infer's typical step, bf16)")
    lines.append(f"{'decoding, torch':<22}{torch_us:>8.1f}   torch - NumPy = "
                 f"{torch_us - numpy_us:.1f} us")
    return "\n".join(lines)


def format_infer(results):
    head = (f"{'case':<14}{'dtype':<7}{'B':>5}{'write':>6}{'N':>4}{'us':>10}{'GB/s':>8}"
            f"{'% copy':>8}{'torch us':>11}{'x torch':>9}")
    lines = [head, "-" * len(head)]
    for r in results:
        pct = f"{r['pct_copy']:>7.0f}%" if "pct_copy" in r else f"{'-':>8}"
        tcols = (f"{r['torch_us']:>11.1f}{r['speedup']:>8.1f}x" if "torch_us" in r
                 else f"{'-':>11}{'-':>9}")
        lines.append(f"{r['case']:<14}{r['dtype']:<7}{r['B']:>5}{r['writers']:>6}{r['N']:>4}"
                     f"{r['us']:>10.1f}{r['gbs']:>8.1f}{pct}{tcols}")
    return "\n".join(lines)


def plot_results(results, path, title):
    """Per case: forward and backward GB/s as bars, the copy bandwidth of the same
    rounds as a line over them, each bar labelled with its % of that copy and, where
    measured, how many times faster than PyTorch. PNG or SVG by ``path``'s suffix;
    needs matplotlib (``pip install matplotlib``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(1.6 + 1.5 * len(results), 4.2))
    width = 0.38
    for i, r in enumerate(results):
        for k, (op, color) in enumerate((("forward", "#4477aa"), ("backward", "#ee6677"))):
            m = r[op]
            x = i + (k - 0.5) * width
            ax.bar(x, m["gbs"], width, color=color, label=op if i == 0 else None)
            text = f"{m['pct_copy']:.0f}%"
            if "speedup" in m:
                text += f"\n{m['speedup']:.0f}x torch"
            ax.text(x, m["gbs"] * 0.5, text, ha="center", va="center", fontsize=7,
                    color="white")
        ax.hlines(r["copy_gbs"], i - width, i + width, colors="black",
                  label="copy, same rounds" if i == 0 else None)
    ax.set_xticks(range(len(results)))
    ax.set_xticklabels([f"T={r['case']['T']} N={r['case']['N']}\nl={r['case']['block']} "
                        f"d={r['case']['stride']} {r['case']['dtype']}" for r in results],
                       fontsize=7)
    ax.set_ylabel("GB/s (bytes read + written)")
    ax.set_title(title, fontsize=8)
    ax.legend(fontsize=7, loc="upper center", ncol=3, frameon=False)
    ax.set_ylim(0, 1.25 * max(r["copy_gbs"] for r in results))
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
