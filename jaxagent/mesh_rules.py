"""The mesh vocabulary and the per-role rules tables, as data: the axis names, the roles, and each named table
mapping logical axes (models' `batch`, `vocab`, `embed`, `mlp`, heads, ...) to mesh axes.

`mesh.rules.<role>` (jaxagent/config.py) chooses a table by name from `RULE_TABLES`; jaxagent/sharding.py
builds meshes and places parameters with them. Imports nothing of jaxagent (docs/design.md §3.1).
"""

from __future__ import annotations

import models

MESH_AXES = ("data", "fsdp", "expert", "tensor")

# Training: parameters FSDP over `fsdp`, tensor parallelism over `tensor`, experts split over `expert`; `batch`
# is for activations and data (the expert axis splits the batch too: outside the experts it is data parallel).
FSDP_TP_RULES: models.Rules = (
    ("batch", ("data", "fsdp", "expert")),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    # Mixture of experts: the experts split over `expert` (expert parallelism: models.MoE's dispatch), each
    # expert's weights laid out as a dense MLP's (embed over fsdp, its width over tensor).
    ("experts", "expert"),
    ("expert_mlp", "tensor"),
    ("q_heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("length", None),
    (models.LAYERS_AXIS, None),  # a layer stack's leading axis: each device holds every layer's share
)

# Decode: weights split over `tensor` only (no all-gather per generated token), the batch over the rest.
TENSOR_PARALLEL_RULES: models.Rules = tuple((name, None if name == "embed" else target)
                                            for name, target in FSDP_TP_RULES)

# Everything replicated but the batch: small models, debugging; the replication guard rejects it on a
# multi-device learner mesh unless mesh.max_replicated_fraction allows it.
REPLICATED_RULES: models.Rules = tuple((name, ("data", "fsdp", "expert") if name == "batch" else None)
                                       for name, _ in FSDP_TP_RULES)

RULE_TABLES: dict[str, models.Rules] = {
    "fsdp_tp": FSDP_TP_RULES,
    "tensor_parallel": TENSOR_PARALLEL_RULES,
    "replicated": REPLICATED_RULES,
}

ROLES = ("rollout", "learner", "reference")
