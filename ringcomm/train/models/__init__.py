"""The model maths: the MLP (:mod:`.mlp`) and the small GPT (:mod:`.gpt`, its attention in
:mod:`.attention`), forward and backward by hand from the pieces in :mod:`.functional`, every
parameter named by a :class:`.specs.ParamSpec`; and :mod:`.stage`, which model a rank trains
and which of its layers and parameters live on this rank. Where a layer communicates it
calls the tensor-parallel pieces of :mod:`ringcomm.train.parallel`; nothing here imports the
data-parallel strategies or the optimizers."""
