"""What training costs, by formula and as measured: model-state memory per strategy and the
registry every buffer is allocated from (:mod:`.memory`, also ``python -m ringcomm.memory``),
the activations kept for backward (:mod:`.activations`), the bytes sent per mesh dimension
(:mod:`.traffic`), the peak a step allocates (:mod:`.peak`), the Chrome trace
(:mod:`.trace`) and what rank 0 prints and writes (:mod:`.report`). The strategies call the
formulas here; nothing here imports the models or the strategies."""
