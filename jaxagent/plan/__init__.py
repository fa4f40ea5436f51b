"""Pod scale before the pod: every program of a run compiled for a TPU topology from a CPU host.

    topology = plan.topology("v5p-64")               # devices from libtpu, no TPU needed
    report = plan.make_plan(config, topology)        # per-program HBM, FLOPs, collectives; the iteration
    print("\\n".join(report.lines())); report.fits
"""

from jaxagent.plan.compiled import Collective, ProgramCost, collectives, compile_program
from jaxagent.plan.fit import Fit, Probe, fit
from jaxagent.plan.planner import Iteration, Plan, make_plan
from jaxagent.plan.topologies import CHIPS, Chip, Topology, TopologyError, known_names, parse, topology

__all__ = ["CHIPS", "Chip", "Collective", "Fit", "Iteration", "Plan", "Probe", "ProgramCost", "Topology",
           "TopologyError", "collectives", "compile_program", "fit", "known_names", "make_plan", "parse", "topology"]
