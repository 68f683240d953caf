"""Interactive dashboards (ipywidgets) on top of the simulator and the plots, one module per dashboard.

Each dashboard is imported on first use, so that the ones whose logic is pure Python load without torch (the
website runs them in the reader's browser).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..lazy import lazy_names

# bound now, not lazily: a function named like its module, which importing the module would put in its place
from .microbatch_chooser import MicrobatchChooser, microbatch_chooser

if TYPE_CHECKING:  # the lazy names below, for type checkers, readers and tests/test_layers.py
    from .balance import BalanceExplorer, balance_explorer
    from .base import Dashboard, schedule_choices
    from .bubble import BubbleExplorer, bubble_explorer, explorer_cost_model
    from .collectives import CollectiveExplorer, collective_explorer
    from .context import ContextExplorer, context_explorer
    from .memory import MemoryExplorer, memory_explorer
    from .planner import PlannerExplorer, planner_explorer
    from .playground import SchedulePlayground, schedule_playground
    from .reshard import ReshardExplorer, reshard_explorer
    from .ring import RingAllReduceExplorer, ring_explorer
    from .sharding import ShardingExplorer, sharding_explorer
    from .staleness import StalenessExplorer, staleness_explorer

# Each name -> its module, imported when the name is first read.
LAZY = {
    "Dashboard": "base", "schedule_choices": "base",
    "BubbleExplorer": "bubble", "bubble_explorer": "bubble", "explorer_cost_model": "bubble",
    "StalenessExplorer": "staleness", "staleness_explorer": "staleness",
    "SchedulePlayground": "playground", "schedule_playground": "playground",
    "PlannerExplorer": "planner", "planner_explorer": "planner",
    "RingAllReduceExplorer": "ring", "ring_explorer": "ring",
    "ShardingExplorer": "sharding", "sharding_explorer": "sharding",
    "BalanceExplorer": "balance", "balance_explorer": "balance",
    "MemoryExplorer": "memory", "memory_explorer": "memory",
    "CollectiveExplorer": "collectives", "collective_explorer": "collectives",
    "ContextExplorer": "context", "context_explorer": "context",
    "ReshardExplorer": "reshard", "reshard_explorer": "reshard",
}

__getattr__, __dir__ = lazy_names(__name__, LAZY, globals())

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
    "CollectiveExplorer", "collective_explorer",
    "ContextExplorer", "context_explorer",
    "ReshardExplorer", "reshard_explorer",
]
