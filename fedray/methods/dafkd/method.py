"""DaFKD: Domain-aware Federated Knowledge Distillation (Wang et al., CVPR 2023).

Round t (Algorithm 1). The server sends the global classifier w_t and generator theta^g_t. Each sampled
client k (lines 15-26) loads them, keeps its own discriminator theta^d_k from its previous round (line 18,
client state here), and for ``federation.local_steps`` steps

- trains classifier and discriminator jointly (Eq. 9): CE on a private batch (Eq. 1) + the adversarial
  BCE of Eq. 2 over the real batch (label 1) and as many generated samples (label 0), averaged over the
  n + n_hat samples as Eq. 2 writes it;
- then trains its copy of the generator against its discriminator (Eq. 3; non-saturating by default).

The generator is the paper's (Sec. 4.1): conditional, label and noise embeddings then fully-connected layers
with BatchNorm and LeakyReLU; clients draw its classes uniformly and the server's distillation set holds
every class equally often. ``generator=dcgan`` is the authors' code's unconditional DCGAN.

With ``sharing=true`` (Sec. 3.4, Fig. 2) the discriminator is ``sigmoid(Linear(feature_dim, 1))`` on the
classifier's ``features(x)``: only that head is the client's own; with ``sharing=false`` it is a separate
network (Table 3, "no-sharing") whose full weights are the client's state.

The server (lines 9-13) averages classifiers (Eq. 6) and generators (Eq. 4), draws the distillation set
from the generator it broadcast this round with a seed derived from (run seed, round), weights each
client per sample by Eq. 7 and distils the weighted ensemble into the averaged classifier by Eq. 8
(:mod:`fedray.methods.dafkd.server`). ``private_discriminator=true`` is Appendix B: the discriminator
never leaves the client; each client draws the same seeded distillation set from the broadcast generator
and uploads f_k(x_i) * s_k(x_i) and f_k(x_i) (the paper sums the f's by secure aggregation; here the
server sums them), and the server normalises. Same seed, same model as the main variant up to
floating-point error (``tests/methods/test_dafkd.py``).

Generated images pass through the classifier's extractor (discriminator, generator and gradient-penalty
steps) with its BatchNorm layers on batch statistics and their running statistics frozen
(:func:`fedray.models.base.frozen_bn_stats`): those describe real data only, as evaluation, the clients'
outputs and the server's distillation (eval mode) assume.

With ``sharing`` Eq. 9 trains the extractor on the discriminator's loss too, so Eq. 2's negatives reach the
classifier: with ``disc_negatives=pooled`` (other clients' real images, a diagnostic) each client's classifier
would learn from classes it does not hold. ``disc_negatives_grad=detached`` computes the negatives' features
without gradient (:func:`~fedray.methods.dafkd.losses.negative_logits`; the gradient penalty's mixes train the head
only): the head still learns to reject them, the extractor learns from the client's own images alone, for pooled and
generated negatives alike, so that "pooled against generated, both detached" changes the negatives only.

Generated images live in the classifier's normalised input space: the generator's tanh output is read
as pixels in [0, 1] and normalised with the dataset's mean/std (:mod:`fedray.models.dcgan`), so real and
fake inputs of the discriminator are on the same scale.

Choices where the paper is silent or disagrees with its authors' code (options expose the code's way):
Eq. 6 / Eq. 4 average uniformly (code: by samples, ``aggregation=samples``); the ensemble is of
probabilities (code: logits, ``ensemble=logits``); Eq. 7 is guarded by adding ``alpha_eps`` to every
f_k, which is uniform when all are 0; no gradient penalty (code: 0.3, ``gp_weight``); adversarial
training in every round (code: only early rounds, ``disc_train_rounds`` / ``gen_train_rounds``);
distillation from round 1 (code: from round 2, ``distill_start_round``), temperature 1 = Eq. 8's plain KL
(code: T=20, Adam lr 1e-4, 40 passes in its shell script, T=10 and lr 1e-5 its argparse defaults; KLDivLoss
averaged over classes too: ``temperature``, ``distill_optimizer``, ``distill_lr``); each client's own discriminator
head across rounds, Alg. 1 line 18 (code: one head in the trainer object every client shares, each starting from
the head the previous client left, never sent to the server; ``disc_head=averaged`` is its nearest order-free
form, one head averaged by the server).

To take the method apart: ``alpha_source`` (Eq. 7 from the discriminators; from Theorem 1's optimal
discriminators under the run's label distributions, ``theorem1``, the weights a discriminator at its optimum would
give; from each client's share of the sample's class, ``label_share``; or uniform) and ``distill_data`` (the
generator's samples, or real unlabelled images of ``data.server_data``). Both oracles weigh a sample by its class
(the class a conditional generator was asked for, or a labelled proxy image's): they measure the weights, not the
samples.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from fedray.methods.api import (Algorithm, ClientContext, ClientResult, ConditionalGenerator, ConfigError,
                                DCGANGenerator, DiagnosticProbe, ServerContext, StepwiseTraining, Weights,
                                batch_plan_rows, build_model, clone_weights, derive_seed, require_server_data,
                                separate_discriminator, soft_targets, to_float)
from fedray.methods.dafkd.server import probe_diagnostics, server_round
from fedray.methods.dafkd.types import (DaFKDClientState, DaFKDModules, DaFKDParams, DaFKDPayload, DaFKDServerState,
                                        DaFKDUpload)
from fedray.methods.dafkd.client import adversarial_steps, batched_local_step, sequential_update
from fedray.methods.dafkd.losses import disc_logits


class DaFKD(Algorithm):
    name = "dafkd"
    synchronous_because = "Eq. 7's ensemble weighs one round's discriminators together"
    Params = DaFKDParams
    mean_only_because = ("Eq. 7's teacher weighs each client's logits per sample by its discriminator (Theorem 1), "
                         "a weighting, not a mean a rule could replace")

    @classmethod
    def check_config(cls, cfg, params: DaFKDParams) -> None:
        """The decomposition options (``alpha_source``, ``distill_data``, ``disc_head``) against the rest."""
        if params.private_discriminator and (params.alpha_source != "discriminator"
                                             or params.distill_data != "generated" or params.disc_head != "own"):
            raise ConfigError("algorithm.private_discriminator", "Appendix B's variant weighs by its clients' "
                              "discriminators on generated samples with their own heads; set it false to change "
                              "alpha_source, distill_data or disc_head")
        oracle = params.alpha_source in ("theorem1", "label_share")
        if not params.correlation and oracle:
            raise ConfigError("algorithm.alpha_source", "correlation=false already means uniform weights; drop it "
                              f"to weigh by {params.alpha_source}")
        if params.diag_reader and params.distill_data != "generated":
            raise ConfigError("algorithm.diag_reader", "the reader scores generated samples, and distill_data=proxy "
                              "distils on real images; set algorithm.distill_data=generated")
        if params.gen_class_weight > 0 and params.generator != "conditional":
            raise ConfigError("algorithm.gen_class_weight", "the class term reads G(z, y) against the asked class y, "
                              "which a dcgan sample does not have; set algorithm.generator=conditional")
        if params.disc_negatives_grad == "detached" and not params.sharing:
            raise ConfigError("algorithm.disc_negatives_grad", "without sharing the discriminator is a separate "
                              "network and the negatives never reach the classifier; set sharing=true or drop it")
        if params.disc_head == "averaged" and not params.sharing:
            raise ConfigError("algorithm.disc_head", "an averaged head needs sharing=true (the head on the "
                              "classifier's extractor); without sharing the discriminator is a whole network")
        if params.distill_data == "proxy":
            require_server_data(cls.name, cfg)
        if params.gp_weight > 0 and cfg.privacy.sample_clip is not None:
            raise ConfigError("algorithm.gp_weight", "the gradient penalty is a gradient inside the loss, which "
                              "DP-SGD's per-example gradients (privacy.sample_clip) do not reach; set it 0 or drop "
                              "privacy.sample_clip")
        if oracle:
            if params.distill_data == "generated" and params.generator != "conditional":
                raise ConfigError("algorithm.alpha_source", f"{params.alpha_source} weighs a sample by its class, "
                                  "which a dcgan sample does not have; set algorithm.generator=conditional or "
                                  "algorithm.distill_data=proxy")
            if params.distill_data == "proxy" and not cfg.data.server_data.labelled:
                raise ConfigError("algorithm.alpha_source", f"{params.alpha_source} weighs a proxy image by its "
                                  "class, so the server's data must be labelled (data.server_data.labelled=true); "
                                  "the distillation itself never reads the labels")

    @classmethod
    def uploads_label_counts(cls, params: DaFKDParams) -> bool:
        """The label-share oracle's weights read each upload's label counts."""
        return params.correlation and params.alpha_source == "label_share"

    @classmethod
    def sends_label_counts(cls, params: DaFKDParams) -> bool:
        """Theorem 1's weights need every registered client's class distribution (the mixture p)."""
        return params.correlation and params.alpha_source == "theorem1"

    @property
    def weighting(self) -> str:
        """Where Eq. 7's weights come from: ``alpha_source``, or uniform without correlation (Table 3)."""
        return self.params.alpha_source if self.params.correlation else "uniform"

    # --- modules ------------------------------------------------------------------------------------
    def _build_disc(self, feature_dim: int) -> nn.Module:
        if self.params.sharing:
            return nn.Linear(feature_dim, 1)
        return separate_discriminator(self.cfg.model.name, self.spec.input_shape)

    def build_modules(self) -> DaFKDModules:
        model = build_model(self.cfg.model.name, self.spec.input_shape, self.spec.num_classes)
        p = self.params
        if p.generator == "conditional":
            gen: nn.Module = ConditionalGenerator(p.noise_dim, self.spec.num_classes, self.spec.input_shape,
                                                  p.gen_hidden, self.spec.mean, self.spec.std)
        else:
            gen = DCGANGenerator(p.noise_dim, self.spec.input_shape, p.gen_width, self.spec.mean, self.spec.std)
        return DaFKDModules(model=model, generator=gen, disc=self._build_disc(model.feature_dim))

    def init_server_state(self, modules: DaFKDModules) -> DaFKDServerState:
        head = clone_weights(modules.disc) if self.params.disc_head == "averaged" else None
        return DaFKDServerState(weights=clone_weights(modules.model), generator=clone_weights(modules.generator),
                                disc=head)

    def init_client_state(self, client_id: int) -> DaFKDClientState:
        # A fresh discriminator drawn from (run seed, client); fork_rng leaves the global RNG untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.cfg.seed, "dafkd/disc-init", client_id) % (1 << 63))
            feature_dim = build_model(self.cfg.model.name, self.spec.input_shape, self.spec.num_classes).feature_dim
            disc = self._build_disc(feature_dim)
        return DaFKDClientState(client_id=client_id, disc=clone_weights(disc))

    def distill_seed(self, round_: int) -> int:
        """Seed of round ``round_``'s distillation noise, shared by the server and (Appendix B) the clients."""
        return derive_seed(self.cfg.seed, "dafkd/distill-noise", round_)

    def broadcast(self, state: DaFKDServerState, round_: int) -> DaFKDPayload:
        seed = self.distill_seed(round_) if self.params.private_discriminator else None
        return DaFKDPayload(weights=state.weights, generator=state.generator, distill_seed=seed, disc=state.disc)

    def global_weights(self, state: DaFKDServerState) -> Weights:
        return state.weights

    def extra_eval_models(self, state: DaFKDServerState) -> dict[str, Weights]:
        return {"avg": state.average} if self.params.eval_average and state.average is not None else {}

    # --- shared by client (Appendix B) and server ---------------------------------------------------
    def disc_logits(self, m: DaFKDModules, x: torch.Tensor, feats: torch.Tensor | None = None) -> torch.Tensor:
        """(B,) logit of f(theta^d; x) (:func:`~fedray.methods.dafkd.losses.disc_logits`)."""
        return disc_logits(self.params, m, x, feats)

    def distillation_set(self, m: DaFKDModules, generator: Weights, seed: int, device: torch.device) -> torch.Tensor:
        """``distill_samples`` images from ``generator`` with noise from ``seed`` (Alg. 1 line 11).

        Generated in chunks of ``federation.batch_size`` with BatchNorm on batch statistics, like the fakes
        the discriminators were trained against (and like the authors' code). The module is only a
        vessel: its running statistics change here, and every use loads weights first.
        """
        p = self.params
        m.generator.load_state_dict(generator)
        m.generator.train()
        z = torch.randn(p.distill_samples, p.noise_dim, generator=torch.Generator().manual_seed(seed % (1 << 63)))
        z, bs = z.to(device), self.cfg.federation.batch_size
        y = (torch.arange(p.distill_samples) % self.spec.num_classes).to(device)  # every class equally often
        with torch.no_grad():
            return torch.cat([m.generator(z[i : i + bs], y[i : i + bs]) for i in range(0, len(z), bs)])

    def distillation_labels(self) -> torch.Tensor | None:
        """The class each sample of :meth:`distillation_set` was generated for (conditional generator); None
        for the DCGAN's, which have none."""
        if self.params.generator != "conditional":
            return None
        return torch.arange(self.params.distill_samples) % self.spec.num_classes

    def distillation_data(self, m: DaFKDModules, generator: Weights, round_: int,
                          device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Round ``round_``'s distillation images and, for the oracles, their classes: the generator's samples
        (``distill_data=generated``) or ``distill_samples`` real images of the server's data drawn anew each round
        (``proxy``: its labels only when it is labelled, which only the oracles read)."""
        if self.params.distill_data == "generated":
            labels = self.distillation_labels()
            return (self.distillation_set(m, generator, self.distill_seed(round_), device),
                    None if labels is None else labels.to(device))
        data = self.server_data
        assert data is not None, "distill_data=proxy needs data.server_data (check_config)"
        rng = torch.Generator().manual_seed(derive_seed(self.cfg.seed, "dafkd/proxy", round_) % (1 << 63))
        idx = torch.randperm(len(data), generator=rng)[: self.params.distill_samples].to(data.x.device)
        x = to_float(data.x[idx], self.spec.mean, self.spec.std).to(device)
        return x, (None if data.y is None else data.y[idx].to(device))

    def client_outputs(self, m: DaFKDModules, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Soft outputs s_k(x) (probabilities at temperature T, or logits) and f_k(x) (None without
        correlation) of the classifier and discriminator loaded in ``m``, in eval mode."""
        m.model.eval()
        m.disc.eval()
        outs, fs, bs = [], [], self.cfg.federation.eval_batch_size
        with torch.no_grad():
            for i in range(0, len(x), bs):
                feats = m.model.features(x[i : i + bs])
                outs.append(m.model.head(feats))
                if self.weighting == "discriminator":
                    fs.append(torch.sigmoid(self.disc_logits(m, x[i : i + bs], feats)))
        logits = torch.cat(outs)
        s = soft_targets(logits, self.params.temperature) if self.params.ensemble == "probs" else logits
        return s, (torch.cat(fs) if fs else None)

    # --- client (Alg. 1 lines 15-26) ----------------------------------------------------------------
    def client_update(self, ctx: ClientContext, payload: DaFKDPayload,
                      state: DaFKDClientState) -> StepwiseTraining | ClientResult:
        """Lines 17-26: as data (:func:`~fedray.methods.dafkd.client.batched_local_step`) for the runtime to run
        alone or batched over clients, with :func:`~fedray.methods.dafkd.client.sequential_update` as its run for
        this client by itself (the reference). With the gradient penalty (a gradient inside the loss, which vmap
        cannot batch here) the sequential update runs at once."""
        plan = batched_local_step(self, ctx, payload, state)
        if plan is None:
            return sequential_update(self, ctx, payload, state)
        return dataclasses.replace(plan, alone=lambda: sequential_update(self, ctx, payload, state))

    # --- server (Alg. 1 lines 9-13) -----------------------------------------------------------------
    #: This round's uploads and the generator it broadcast, kept for probe_diagnostics (only on a round it runs;
    #: not server state)
    _round_uploads: list[DaFKDUpload] | None = None
    _round_generator: Weights | None = None

    def client_samples(self, ctx: ClientContext) -> int:
        """Its batches, and in the adversarial steps a generated batch as large for D (Eq. 2) and another for G
        (Eq. 3), each through the generator and the discriminator."""
        round_d, round_g, adv_steps = adversarial_steps(self, ctx)
        generated = batch_plan_rows(ctx.num_samples, ctx.fed.batch_size, adv_steps) * (int(round_d) + int(round_g))
        return super().client_samples(ctx) + generated

    def server_samples(self, uploads: int) -> int:
        """The distillation set generated and labelled by each upload's classifier and discriminator (Eq. 7-8),
        then the student's distillation steps."""
        p = self.params
        return p.distill_samples * (1 + uploads) + p.distill_steps * p.distill_batch_size

    def server_update(self, state: DaFKDServerState, uploads: list[DaFKDUpload],
                      ctx: ServerContext) -> tuple[DaFKDServerState, dict[str, float]]:
        # held on a diagnosed round only: otherwise nothing would release them before the next round's arrive
        diagnosed = self.cfg.federation.diagnoses(ctx.round)
        self._round_uploads = uploads if diagnosed and self.params.diag_samples else None
        self._round_generator = state.generator if diagnosed and self.wants_reader() else None
        return server_round(self, state, uploads, ctx)

    def probe_size(self) -> int:
        return self.params.diag_samples

    def wants_reader(self) -> bool:
        return self.params.diag_reader

    def wants_pooled_images(self) -> bool:
        return self.params.disc_negatives == "pooled"

    def probe_diagnostics(self, ctx: ServerContext, probe: DiagnosticProbe, client_ids: list[int]) -> dict[str, float]:
        uploads, self._round_uploads = self._round_uploads, None
        generator, self._round_generator = self._round_generator, None
        out = probe_diagnostics(self, uploads, probe, client_ids, ctx) if uploads else {}
        if generator is not None and probe.reader is not None:  # the round's distillation set, drawn again
            x, asked = self.distillation_data(ctx.modules, generator, ctx.round, ctx.device)
            out.update(probe.reader.read(x, asked))
        return out

