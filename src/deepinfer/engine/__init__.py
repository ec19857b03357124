"""Request execution. For now a lockstep generator; the scheduler/cache manager replace it."""
