"""Studies made of many points: recipes, comparisons at matched budgets, sweeps; the
points run serially or as Ray tasks through :func:`prunelab.workflow.executor.run_points`."""
