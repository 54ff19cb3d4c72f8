"""Models from a recipe: timm VisionTransformer (CLS or GAP head), a timm ResNet baseline for small images, and a
timm MLP-Mixer (Raghu et al. 2021 App. H: a third, attention-free token architecture)."""

from __future__ import annotations

import torch
import torch.nn as nn
from timm.models.mlp_mixer import MixerBlock, MlpMixer
from timm.models.resnet import BasicBlock, Bottleneck, ResNet, make_blocks
from timm.models.vision_transformer import Block, VisionTransformer

from interventions import apply_model, block_fn_for, model_interventions


def build_model(recipe, num_classes: int) -> nn.Module:
    """The recipe's model with its interventions applied (see interventions/); with ``model.init_seed`` its initial
    weights are drawn from a generator seeded with it, leaving the global generator (the data order) as it was."""
    if getattr(recipe.model, "init_seed", None) is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.model.init_seed)
            return _build_model(recipe, num_classes)
    return _build_model(recipe, num_classes)


def _build_model(recipe, num_classes: int) -> nn.Module:
    m, d = recipe.model, recipe.data
    if m.arch == "vit":
        # DINO's local crops are smaller than data.img_size: timm's dynamic_img_size resamples the position embedding
        model = build_vit(
            m,
            d.img_size,
            d.in_chans,
            num_classes,
            recipe.interventions,
            dynamic_img_size=recipe.train.objective == "dino",
        )
    elif model_interventions(recipe.interventions):  # each intervention's check says so first, in recipe terms
        raise ValueError(
            f"interventions {', '.join(model_interventions(recipe.interventions))} apply to ViTs only, "
            f"not to model.arch {m.arch!r}."
        )
    elif m.arch == "mixer":
        model = build_mixer(m, d.img_size, d.in_chans, num_classes)
    elif m.arch == "resnet":
        model = build_resnet(m, d.in_chans, num_classes)
    else:
        raise ValueError(f"unknown model.arch {m.arch!r}: choose vit, resnet or mixer.")
    apply_model(model, recipe.interventions)
    return model


def build_vit(
    m, img_size: int, in_chans: int, num_classes: int, interventions=None, dynamic_img_size: bool = False
) -> nn.Module:
    """timm VisionTransformer. ``head: cls`` classifies the class token (global_pool='token');
    ``head: gap`` has no class token and classifies the mean of the final tokens (global_pool='avg').
    ``dynamic_img_size``: inputs of another size (a multiple of the patch) are accepted, the position embedding
    resampled (bicubic) to their grid; at ``img_size`` the outputs and the state dict are the same as without it."""
    cls = m.head == "cls"
    return VisionTransformer(
        img_size=img_size,
        patch_size=m.patch_size,
        in_chans=in_chans,
        num_classes=num_classes,
        embed_dim=m.embed_dim,
        depth=m.depth,
        num_heads=m.num_heads,
        mlp_ratio=m.mlp_ratio,
        class_token=cls,
        reg_tokens=m.reg_tokens,
        global_pool="token" if cls else "avg",
        drop_path_rate=m.drop_path,
        drop_rate=m.dropout,  # after the position embedding (and before the head)
        proj_drop_rate=m.dropout,  # after the attention output projection and each MLP layer
        block_fn=block_fn_for(interventions, Block),
        dynamic_img_size=dynamic_img_size,
    )


def build_mixer(m, img_size: int, in_chans: int, num_classes: int) -> nn.Module:
    """timm MlpMixer of ``depth`` MixerBlocks at width ``embed_dim`` on a (img_size/patch_size)^2 token grid, no
    class token, classifying the token mean (global_pool='avg'). Hidden widths, both counted in units of
    embed_dim as timm does: token-mixing MLP ``int(mixer_token_ratio * embed_dim)``, channel-mixing MLP
    ``int(mlp_ratio * embed_dim)``. ``drop_path`` is the same in every block (timm's MlpMixer rule)."""
    return MlpMixer(
        img_size=img_size,
        patch_size=m.patch_size,
        in_chans=in_chans,
        num_classes=num_classes,
        embed_dim=m.embed_dim,
        num_blocks=m.depth,
        mlp_ratio=(m.mixer_token_ratio, m.mlp_ratio),
        block_layer=MixerBlock,
        global_pool="avg",
        drop_rate=m.dropout,
        proj_drop_rate=m.dropout,
        drop_path_rate=m.drop_path,
    )


def build_resnet(m, in_chans: int, num_classes: int) -> nn.Module:
    """timm ResNet with BasicBlocks or (``resnet_block: bottleneck``) Bottlenecks: ResNet-50 is bottleneck blocks
    with layers [3, 4, 6, 3] and channels [64, 128, 256, 512] (x4 expansion), the 7x7/2 stem and max-pool
    (``small_stem: false``, timm's stem: always 64 channels wide).

    ``small_stem`` swaps that stem for one 3x3/1 conv without max-pool, so 28-32 px images keep their resolution into
    the first stage (as CIFAR ResNets do), and makes the stem exactly as wide as the first stage
    (``resnet_channels[0]``). timm's ResNet ties a one-conv stem to 64 channels, which would give the first stage's
    first block a 1x1-conv projection shortcut whenever ``resnet_channels[0] != 64``; so the stages are built with
    timm's own ``make_blocks`` from the stem's width instead. With BasicBlocks every block of the first stage then
    has an IDENTITY shortcut at any width, and of each later stage only the first (strided) block projects, as in
    ResNet-18/34. (With Bottlenecks the first block widens to 4 x ``resnet_channels[0]`` and projects, as in
    ResNet-50.)"""
    block = Bottleneck if m.resnet_block == "bottleneck" else BasicBlock
    layers, channels = tuple(m.resnet_layers), tuple(m.resnet_channels)
    model = ResNet(
        block=block,
        layers=layers,
        channels=channels,
        in_chans=in_chans,
        num_classes=num_classes,
        drop_path_rate=m.drop_path,
    )
    if m.small_stem:
        width = channels[0]
        model.conv1 = nn.Conv2d(in_chans, width, kernel_size=3, stride=1, padding=1, bias=False)
        model.bn1 = nn.BatchNorm2d(width)
        model.maxpool = nn.Identity()
        stages, stage_info = make_blocks(
            (block,) * len(channels), channels, layers, inplanes=width, drop_path_rate=m.drop_path
        )
        for name, stage in stages:
            setattr(model, name, stage)
        # strides relative to the input: timm's counts assume its /4 stem (conv /2 and max-pool /2)
        model.feature_info = [dict(num_chs=width, reduction=1, module="act1")] + [
            dict(info, reduction=info["reduction"] // 4) for info in stage_info
        ]
        model.init_weights()  # timm's init (kaiming convs, zero last BN of each branch) for the new modules too
    return model
