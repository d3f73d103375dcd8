"""Evaluation harness: every KV-selection method of the HashAttention paper on one model.

* :mod:`.selectors` -- one file per selector (full, oracle, StreamingLLM, H2O, Quest,
  Double Sparsity, SimHash LSH, HashAttention), discovered by a registry;
* :mod:`.attention_hook` -- runs the selectors inside the model through the package's attention
  function: dense rows through SDPA, sparse rows through the selector and
  :func:`hashattention.sparse_attention`;
* :mod:`.metrics` -- recall of the true top-k, attention mass, NLL, RULER string match;
* :mod:`.tasks` -- RULER-style synthetic tasks generated from local text;
* :mod:`.harness` -- the evaluation loop with a resumable per-sample cache (:mod:`.store`);
* :mod:`.report` -- Markdown, JSON and PNG output; :mod:`.cli` -- the command line.
"""

from .harness import Evaluation, EvaluationConfig  # noqa: F401
from .selectors import Budget, create_selector, selector_names  # noqa: F401
