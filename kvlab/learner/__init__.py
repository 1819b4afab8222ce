"""The learner's side of the course: predictions before answers, and progress kept locally.

* :func:`predict` (``kvlab.learner.prediction``): a "predict, then run" prompt. The answer cell
  below it runs as usual, but what it prints stays hidden until the learner has locked in a
  prediction; then prediction and result appear side by side.
* :mod:`kvlab.learner.store`: one JSON file outside the repository (``$KVLAB_HOME`` or
  ``~/.kvlab``) that keeps every locked prediction and every exercise the learner passed.
  Lesson 00 reads it (``kvlab.exercises.show_progress()``).

Nothing here imports the engine: the exercises import the store, never the other way.
"""

from kvlab.learner.prediction import Prediction, interactive, predict
from kvlab.learner.store import Store, store

__all__ = ["Prediction", "Store", "interactive", "predict", "store"]
