"""Pictures for the notebooks, one module per topic; every function returns a matplotlib Figure.

matplotlib is imported here only, never by the package's core.
"""

from .checkpoint import mtbf_vs_gpus, reshard_map, resume_curves, save_protocol, young_daly  # noqa: F401
from .collectives import (  # noqa: F401
    bandwidth_plot,
    binomial_tree,
    collectives_gallery,
    hierarchy_chart,
    ring_reduce_scatter_steps,
)
from .data_parallel import bucket_sweep, ddp_step_times, ddp_timeline  # noqa: F401
from .experts import dispatch_diagram, drop_rate_plot, host_timeline, load_histograms  # noqa: F401
from .memory import fsdp_timeline, fsdp_unit_life, speedup_beside_published, zero_memory_bars  # noqa: F401
from .mesh import best_layout_heatmap, mesh_diagram, plan_breakdown  # noqa: F401
from .pipeline import activations_per_stage, bubble_vs_microbatches, gantt, gantt_stack  # noqa: F401
from .scaling import dp_crossover, dp_ratio_vs_gpus, roofline  # noqa: F401
from .tensor_parallel import (  # noqa: F401
    activation_memory_chart,
    column_row_split,
    ring_attention_steps,
    tp_block_flow,
    tp_step_time_vs_bandwidth,
)
from .topology import fat_tree_and_torus  # noqa: F401
