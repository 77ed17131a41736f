"""DaFKD's local step (Alg. 1 lines 19-25) as data, so the runtime can batch it over clients
(``runtime.vectorize``): per local step two updates, (1) classifier and discriminator on Eq. 9, then
(2) the generator on Eq. 3 against the just-updated discriminator, on the batch and the noise drawn in
the order ``DaFKD.client_update`` draws them. ``client_update`` is the sequential reference; the losses are
its own pieces (``DaFKD._disc_loss``, ``DaFKD._gen_loss``), so the two cannot drift apart.

The step is ``paddable``: a short batch may come padded to the step's longest (rows labelled ``IGNORE_LABEL``),
its noise (and conditional labels) with zero rows to the longest client's. The losses then count the real rows
only: the batch's real rows are those not labelled so, and of the generated ones the first ``fake_count`` of
them, as drawn; BatchNorm layers normalise by those rows alone (``batch_rows``), as do the means of the losses
and the discriminator's accuracy counts.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from fedray.algorithms.base import ClientContext, ClientResult
from fedray.algorithms.training import IGNORE_LABEL, OptimSpec, StepwiseTraining, Update, module_dict, weights_only
from fedray.models.base import batch_rows

if TYPE_CHECKING:
    from fedray.algorithms.dafkd import DaFKD, DaFKDClientState, DaFKDPayload


def batched_local_step(algo: "DaFKD", ctx: ClientContext, payload: "DaFKDPayload",
                       state: "DaFKDClientState") -> StepwiseTraining | None:
    """This client's local training as a :class:`StepwiseTraining`; None with the gradient penalty (a gradient
    inside the loss, which ``vmap`` cannot batch here): that runs sequentially."""
    from fedray.algorithms.dafkd import DaFKDModules  # dafkd imports this module

    p, m, fed = algo.params, ctx.modules, ctx.fed
    if p.gp_weight > 0:
        return None
    assert state.client_id == ctx.client_id, "a client received another client's discriminator"
    round_d, round_g, adv_steps = algo._adversarial_steps(ctx, state)
    batches, noise = ctx.batch_plan(), ctx.generator("dafkd/noise")

    def inputs(step: int) -> tuple[dict[str, torch.Tensor], tuple[bool, ...]]:
        # x and y are the step's batch (``batches``, gathered by the runtime); the noise is drawn here on the host,
        # in client_update's order of draws, and the runtime stacks it over clients before one copy to the device
        b, inp = algo.fake_count(len(batches.index[step])), {}
        train_d, train_g = round_d and step < adv_steps, round_g and step < adv_steps
        for flag, key in ((train_d, "fake"), (train_g, "gen")):
            if flag:
                inp[f"z_{key}"] = torch.randn(b, p.noise_dim, generator=noise)
                labels = algo._labels(b, noise, torch.device("cpu"))
                if labels is not None:
                    inp[f"labels_{key}"] = labels
        return inp, (True, train_g, train_d)

    def view(mods: nn.ModuleDict) -> DaFKDModules:
        return DaFKDModules(model=mods["model"], generator=mods["generator"], disc=mods["disc"])

    def rows(inp: dict[str, torch.Tensor], noise: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The real rows of the step's batch and of its generated batch from ``inp[noise]`` (bool masks)."""
        real = inp["y"] != IGNORE_LABEL
        drawn = algo.fake_count(real.sum())
        return real, torch.arange(inp[noise].shape[0], device=real.device) < drawn

    def classifier_loss(mods: nn.ModuleDict, inp: dict[str, torch.Tensor], flags: tuple):  # Eq. 9
        mm = view(mods)
        real, fake_rows = rows(inp, "z_fake") if flags[2] else (inp["y"] != IGNORE_LABEL, None)
        with batch_rows(real):
            feats = mm.model.features(inp["x"])
        ce = F.cross_entropy(mm.model.head(feats), inp["y"])  # IGNORE_LABEL rows left out
        if not flags[2]:
            return ce, {"ce": ce}
        with torch.no_grad(), batch_rows(fake_rows):
            fake = mm.generator(inp["z_fake"], inp.get("labels_fake"))
        adv, d_real, d_fake = algo._disc_loss(mm, inp["x"], feats, fake, real, fake_rows)
        return ce + adv, {"ce": ce, "adv": adv, "real_ok": ((d_real.detach() > 0) & real).sum().float(),
                          "fake_ok": ((d_fake.detach() < 0) & fake_rows).sum().float(), "n": real.sum().float()}

    def generator_loss(mods: nn.ModuleDict, inp: dict[str, torch.Tensor], flags: tuple):  # Eq. 3
        g_loss = algo._gen_loss(view(mods), inp["z_gen"], inp.get("labels_gen"), rows(inp, "z_gen")[1])
        return g_loss, {"gen": g_loss}

    def finish(mods: nn.ModuleDict, sums: dict[str, float], optimizer_state: dict) -> ClientResult:
        return algo._result(ctx, view(mods), payload, state, algo._metrics(sums, round_d, round_g, adv_steps))

    if not p.private_discriminator:  # then _result only clones the weights; else it runs the trained modules
        weights_only(finish)

    gen_spec = OptimSpec("adam", p.gen_lr, weight_decay=fed.weight_decay, betas=(0.5, 0.999))
    return StepwiseTraining(
        modules=module_dict(algo, model=m.model, generator=m.generator, disc=m.disc),
        start={"model": payload.weights, "generator": payload.generator, "disc": state.disc},
        updates=[Update(classifier_loss, {"model": OptimSpec.of(fed), "disc": OptimSpec.of(fed, lr=p.disc_lr)},
                        trains=lambda flags: {"model", "disc"} if flags[2] else {"model"}),
                 Update(generator_loss, {"generator": gen_spec})],
        steps=ctx.num_local_steps(), inputs=inputs, finish=finish, batches=batches, paddable=True)
