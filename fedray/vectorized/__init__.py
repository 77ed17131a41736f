"""The vectorised-client engine: a worker's clients of a round trained in lockstep as one batched computation
over stacked parameters (torch.func), with stacked optimizers (:mod:`.stacked_optimizer`), the round's batches
(:mod:`.round_batches`), phases for clients done early (:mod:`.phases`), CUDA-graph steps (:mod:`.step_graph`) and
the local precision (:mod:`.precision`). The runtime chooses it (:mod:`.policy`); methods never see it: they hand
the runtime training plans (:mod:`fedray.learning.training`)."""
