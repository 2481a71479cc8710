"""The pipeline's core: the stage graph and its key recipes, the run options, per-sample planning,
the stored samples of a selection, reports as shown, progress. Stages (runner/stages/) build on it."""
