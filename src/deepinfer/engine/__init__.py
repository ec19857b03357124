"""Request execution: block pool and prefix cache, scheduler, paged cache layout, model
runner and the engine step loop (docs/architecture.md, 'The flow of one engine step')."""
