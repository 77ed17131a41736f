"""What methods share, below the methods and above the data and models: the types that cross the client/server
boundary (:mod:`.boundary`), local training as data (:mod:`.training`), distillation losses and steps
(:mod:`.distill`, :mod:`.proxy_distill`), teacher ensembles (:mod:`.ensemble`), functional optimizers
(:mod:`.optim`), weight arithmetic (:mod:`.weights`), subspaces (:mod:`.subspace`), cached-model aggregation
(:mod:`.cached`) and replayed CUDA-graph steps (:mod:`.cuda_graphs`). Nothing here knows a method by name."""
