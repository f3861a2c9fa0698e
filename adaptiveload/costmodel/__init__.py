"""How long a micro-batch takes and how much memory it needs: one interface for the planner,
the simulator and the analysis.

- `cost`: the cost model (`CostModel`: t = max(t_floor, c0 + Σ (c_seq + a S + b S²)), memory
  m_static + Σ (m_tok S + m_seq)) and the epoch bound's limits;
- `comm`: sequence-parallel all-to-alls and the cost of a set at a degree;
- `budgets`: p, M_mem, M_comp and M_tok derived from a cost model (BUDGET_RULES);
- `calibration`: the calibration file, the shipped ones and the budgets file.

Every public name is importable from `adaptiveload.costmodel` itself.
"""

from adaptiveload.costmodel.budgets import (
    BUDGET_RULES,
    DEFAULT_HEADROOM,
    REFERENCE_RULES,
    BudgetDerivation,
    capacity_for,
    derive_budgets,
    local_exponent,
    memory_budget,
    reference_tokens,
)
from adaptiveload.costmodel.calibration import (
    BUDGETS_FILE_FIELDS,
    Calibration,
    budgets_record,
    group_bound,
    read_budgets,
    shipped_calibrations,
)
from adaptiveload.costmodel.comm import (
    ALL_TO_ALLS_PER_PASS,
    COMM_BACKENDS,
    COMM_SOURCES,
    INFINIBAND_BYTES_PER_S,
    INFINIBAND_LATENCY_S,
    NODE_SIZE,
    NVLINK_BYTES_PER_S,
    NVLINK_LATENCY_S,
    PRIOR_DEVICE,
    PRIOR_MAX_DEGREE,
    TENSORS_PER_PASS,
    CommLink,
    CommModel,
    GroupBound,
    SequenceParallel,
)
from adaptiveload.costmodel.cost import (
    CAP_TOLERANCE,
    MEMORY_TERMS,
    TIME_TERMS,
    CostModel,
    EpochBound,
    EpochLimits,
    combine,
    features,
    memory_features,
    within_cap,
)

__all__ = [
    "ALL_TO_ALLS_PER_PASS",
    "BUDGETS_FILE_FIELDS",
    "BUDGET_RULES",
    "CAP_TOLERANCE",
    "COMM_BACKENDS",
    "COMM_SOURCES",
    "DEFAULT_HEADROOM",
    "INFINIBAND_BYTES_PER_S",
    "INFINIBAND_LATENCY_S",
    "MEMORY_TERMS",
    "NODE_SIZE",
    "NVLINK_BYTES_PER_S",
    "NVLINK_LATENCY_S",
    "PRIOR_DEVICE",
    "PRIOR_MAX_DEGREE",
    "REFERENCE_RULES",
    "TENSORS_PER_PASS",
    "TIME_TERMS",
    "BudgetDerivation",
    "Calibration",
    "CommLink",
    "CommModel",
    "CostModel",
    "EpochBound",
    "EpochLimits",
    "GroupBound",
    "SequenceParallel",
    "budgets_record",
    "capacity_for",
    "combine",
    "derive_budgets",
    "features",
    "group_bound",
    "local_exponent",
    "memory_budget",
    "memory_features",
    "read_budgets",
    "reference_tokens",
    "shipped_calibrations",
    "within_cap",
]
