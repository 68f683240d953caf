"""Interactive dashboards (ipywidgets) on top of the simulator and the plots, one module per dashboard."""

from .balance import BalanceExplorer, balance_explorer
from .base import Dashboard, schedule_choices
from .bubble import BubbleExplorer, bubble_explorer, explorer_cost_model
from .memory import MemoryExplorer, memory_explorer
from .microbatch_chooser import MicrobatchChooser, microbatch_chooser
from .planner import PlannerExplorer, planner_explorer
from .playground import SchedulePlayground, schedule_playground
from .ring import RingAllReduceExplorer, ring_explorer
from .sharding import ShardingExplorer, sharding_explorer
from .staleness import StalenessExplorer, staleness_explorer

__all__ = [
    "Dashboard", "schedule_choices",
    "BubbleExplorer", "bubble_explorer", "explorer_cost_model",
    "StalenessExplorer", "staleness_explorer",
    "SchedulePlayground", "schedule_playground",
    "PlannerExplorer", "planner_explorer",
    "RingAllReduceExplorer", "ring_explorer",
    "ShardingExplorer", "sharding_explorer",
    "BalanceExplorer", "balance_explorer",
    "MicrobatchChooser", "microbatch_chooser",
    "MemoryExplorer", "memory_explorer",
]
