"""Reports on probe results: plots and Markdown summaries."""
