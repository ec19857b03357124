"""Request execution: block pool and prefix cache, scheduler, paged cache layout, model
runner and the engine step loop (DESIGN.md §2)."""
