"""Inspection tools: `benchmark` (every candidate on given inputs), `profiler` (which kernel each call
ran, and how fast), `debug` (where a model first produces NaN/Inf). `ops_adv.profiler` and
`ops_adv.debug` are these modules."""
