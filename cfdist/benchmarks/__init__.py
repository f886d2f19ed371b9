"""``cfdist bench``: cfdist against its peers, measured from the outside, in one run.

Entry-point layer: it trains real models under each method (:mod:`.methods`, :mod:`.workloads`,
:mod:`.runner`), measures disk and memory references (:mod:`.micro`), and turns the runs into
ratios, a markdown report, plots and the summary table of docs/benchmarks.md (:mod:`.measure`, :mod:`.report`).
:mod:`.suite` says what each mode runs; :mod:`.cli` is the command.
"""
