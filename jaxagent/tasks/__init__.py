"""Task supply (docs/design.md §2.7): what train tasks a run draws (`supply`: uniform stream or frontier curriculum),
near-duplicate checks between splits (`contamination`), and the generate → execute → filter pipeline
(`pipeline`, the `jaxagent tasks` verbs)."""

from jaxagent.tasks.supply import FrontierTasks, TaskSupply, UniformTasks, make_supply, stream

__all__ = ["FrontierTasks", "TaskSupply", "UniformTasks", "make_supply", "stream"]
