"""`rstar-hpc report RUN`: what a run's user looks at, rendered from the run directory alone.

    records.py   streaming reads of metrics/<role>.jsonl (a torn last line of a killed job is skipped)
    series.py    which recorded key each figure reads, and the figures derived from several keys
    rundata.py   one run loaded: per-step series on one RL step axis across stages, eval results
    figures.py   headline figures and the pass@1 table rows (numbers only; no plotting)
    plots.py     the PNG plots (matplotlib, Agg), compared runs overlaid
    render.py    report.md and report.html from one document
    build.py     all of it: build_report(run, compare, out) -> Report
    phases.py    where a run's wall time went: the job's start, each stage from the previous one's end, the end

Nothing here is imported by a role; matplotlib is imported only when plotting.
"""
