"""rlc's compiler: recipes, rules, the memory planner and launch bundles."""
import gc


def collect_rarely() -> None:
    """The collector's young generation every 50,000 allocations instead of 700, for a command line run: the
    process is short-lived and what it allocates (modules, classes, the recipe and its plan) stays alive, so
    frequent collections only traverse it."""
    gc.set_threshold(50_000)
