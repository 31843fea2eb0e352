"""The zoo's model names, importable without torch: the command lines validate against them before
any worker (or torch) starts. `commsched.models` builds these names' networks."""

RESNET_DEPTHS = (18, 34, 50, 101, 152)
VGG_DEPTHS = (11, 16, 19)
IMAGE_ARCHS = (
    *(f"resnet{d}" for d in RESNET_DEPTHS),
    *(f"vgg{d}{bn}" for d in VGG_DEPTHS for bn in ("", "_bn")),
    "small_cnn",
)
GPT2_SIZES = ("tiny", "small")
