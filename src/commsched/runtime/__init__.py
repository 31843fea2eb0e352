"""The Lightning strategy at run time: `CommSchedStrategy` and its lifecycle (`strategy`), the engine
that carries out one fit's links, plans, schedules and hand-overs (`engine`), the registry that makes
a strategy of each schedule (`registry`), what it refuses (`refusals`), what it reports and says at the
end (`run_reports`, `run_summary`, `callbacks`), stopping with a checkpoint on a signal
(`interrupt`), the flush at the loop's epoch-level hooks (`observers`), and DDP's rules it keeps
(`buffer_sync`, `lr_follow`). The top of the package: nothing below imports it. This file imports
nothing, so `import commsched` stays free of torch until a strategy is asked for."""
