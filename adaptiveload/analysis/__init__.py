"""Analysis: the per-step tables of training runs and simulations -> one tidy table ->
statistical tests, paper tables, figures, and their MLflow record.

Modules: `aggregate` (collect), `stats` (tests and CIs), `tables` (paper/kernel tables),
`figures` (PNG figures), `paper_map` (what the simulated map of the paper's choices says),
`record` (log the analysis to MLflow).
"""
