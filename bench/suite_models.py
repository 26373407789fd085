"""The public model suite's models: torchvision, timm, transformers and torch.nn's own layers.

Every model is built from code with random weights (``weights=None``, ``pretrained=False``,
``AutoModel``-style ``Model(Config(...))``): nothing is downloaded. Each :class:`Case` says how
to build the model and its inputs; ``bench/model_suite.py`` runs every column on it and
``tests/test_model_suite.py`` runs the CI subset through the same code.

Inputs come in named sets (:data:`INPUT_SETS`), drawn from fixed seeds:

- ``example``: what the model is exported with (batch 2 unless the model is heavy);
- ``batch``: a second batch size (3), and for text models also another sequence length (11)
  and another padding pattern: a graph that baked the batch, the length or the mask fails it;
- ``pad`` (models with an attention mask): the example's shape with another padding pattern,
  which only a graph that baked the example's mask values answers wrong;
- ``latency``: batch 1 (and the example's sequence length), the size timed.

Text models get what a tokenizer gives (``input_ids`` and an ``attention_mask`` with right
padding, pad positions holding the pad id), as a user would pass them.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import nn

SEED = 0
INPUT_SETS = ("example", "batch", "pad", "latency")

# Right-padding lengths per input set, as fractions of the sequence (1.0: no padding).
_PAD_FRACTIONS = {"example": (1.0, 0.6), "batch": (0.4, 1.0, 0.7), "pad": (0.75, 1.0), "latency": (1.0,)}


@dataclass
class Case:
    """One model of the suite."""

    name: str  # unique, e.g. "resnet18", "timm/convnext_atto", "hf/bert"
    family: str  # torchvision | timm | transformers | torch
    kind: str  # classification, segmentation, video, text encoder, decoder, ...
    build: Callable[[], nn.Module]
    make_inputs: Callable[[str], dict[str, torch.Tensor]]  # input set name -> inputs by argument name
    dynamic: dict[str, dict[int, str]]  # what kiln.trace(dynamic=...) takes
    note: str = ""  # what was chosen for this model (input size, config) and why
    has_mask: bool = False  # has an attention mask: the "pad" input set applies
    heavy: bool = False  # batch 1 / 2 instead of 2 / 3, longer timeout
    timeout: Optional[float] = None  # seconds, overrides the suite's default per model
    config: dict = field(default_factory=dict)

    def inputs(self, which: str) -> dict[str, torch.Tensor]:
        return self.make_inputs(which)


def _gen(which: str, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(SEED + 1 + 101 * INPUT_SETS.index(which) + salt)


def _batch(which: str, heavy: bool = False) -> int:
    if which == "latency":
        return 1
    if which == "batch":
        return 2 if heavy else 3
    return 1 if heavy else 2


def seeded(build: Callable[[], nn.Module]) -> nn.Module:
    """Build with weights from the fixed seed, in eval mode. BatchNorm statistics are moved off
    their initial 0/1 a little, so that BN folding is really exercised (as in tests/zoo.py, but
    milder: these networks are deep, and gains of 1.5 a layer would blow them up)."""
    torch.manual_seed(SEED)
    model = build()
    gen = torch.Generator().manual_seed(SEED + 7)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(torch.randn(m.running_mean.shape, generator=gen) * 0.1)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=gen) * 0.4 + 0.8)
    return model.eval()


def _first_param(model_fn: Callable) -> str:
    return next(iter(inspect.signature(model_fn).parameters))


# ---------------------------------------------------------------------------- images and video
def _image_inputs(name: str, shape: tuple[int, ...], heavy: bool = False):
    def make(which: str) -> dict[str, torch.Tensor]:
        return {name: torch.randn(_batch(which, heavy), *shape, generator=_gen(which))}
    return make


def _image_case(name: str, family: str, kind: str, build: Callable[[], nn.Module], shape: tuple[int, ...],
                input_name: str = "x", note: str = "", heavy: bool = False, timeout: Optional[float] = None) -> Case:
    size = "x".join(map(str, shape))
    return Case(name, family, kind, lambda: seeded(build), _image_inputs(input_name, shape, heavy),
                {input_name: {0: "batch"}}, note=note or f"input Nx{size}", heavy=heavy, timeout=timeout)


# torchvision: input sizes. 64x64 where the network takes it (global pooling at the end); the
# size a model's fixed-size parts need otherwise (said in the note).
_TV_SIZE = {
    # AdaptiveAvgPool2d((7, 7)) / ((6, 6)) after /32: 224 is the size where it is a plain pool
    # (at 64 it would upsample a 2x2 map, a path no user of these models takes).
    **{n: 224 for n in ("alexnet", "vgg11", "vgg11_bn", "vgg13", "vgg13_bn", "vgg16", "vgg16_bn", "vgg19",
                        "vgg19_bn")},
    "inception_v3": 96,  # needs at least 75x75
    "maxvit_t": 224,  # every stage's map must divide by the partition size 7
}
# ViTs: image_size is a constructor argument (a multiple of the patch size).
_TV_VIT_IMAGE = {"vit_b_16": 64, "vit_b_32": 64, "vit_l_16": 64, "vit_l_32": 64, "vit_h_14": 56}
_TV_HEAVY = {"vit_h_14", "regnet_y_128gf", "regnet_y_32gf", "regnet_x_32gf", "vit_l_16", "vit_l_32",
             "efficientnet_v2_l", "maxvit_t", "vgg19_bn", "vgg19", "vgg16", "vgg16_bn"}
_TV_VIDEO = {
    "mvit_v1_b": ((3, 16, 224, 224), "mvit_v1_b fixes spatial 224, temporal 16 in its builder"),
    "mvit_v2_s": ((3, 16, 224, 224), "mvit_v2_s fixes spatial 224, temporal 16 in its builder"),
    "s3d": ((3, 16, 224, 224), "s3d's last AvgPool3d is (2, 7, 7): 224x224, 16 frames"),
}


def torchvision_cases() -> list[Case]:
    import torchvision
    from torchvision import models

    cases = []

    def builder(name: str, **kw: Any) -> Callable[[], nn.Module]:
        def build() -> nn.Module:
            import warnings
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)  # googlenet/inception init notices
                return models.get_model(name, weights=None, **kw)
        return build

    for name in models.list_models(module=models):
        kw: dict = {}
        if name in _TV_VIT_IMAGE:
            kw["image_size"] = size = _TV_VIT_IMAGE[name]
            note = f"image_size={size} (a constructor argument), input Nx3x{size}x{size}"
        else:
            size = _TV_SIZE.get(name, 64)
            note = ""
        heavy = name in _TV_HEAVY
        cases.append(_image_case(name, "torchvision", "classification", builder(name, **kw), (3, size, size),
                                 note=note, heavy=heavy, timeout=1800 if heavy else None))
    for name in models.list_models(module=models.segmentation):
        cases.append(_image_case(name, "torchvision", "segmentation", builder(name, weights_backbone=None),
                                 (3, 64, 64), note="weights_backbone=None, input Nx3x64x64",
                                 heavy="101" in name))
    for name in models.list_models(module=models.video):
        shape, note = _TV_VIDEO.get(name, ((3, 4, 64, 64), ""))
        heavy = name in _TV_VIDEO or name.startswith("swin3d_b")
        cases.append(_image_case(name, "torchvision", "video", builder(name), shape, note=note, heavy=heavy,
                                 timeout=2400 if name in _TV_VIDEO else None))
    del torchvision
    return cases


# ---------------------------------------------------------------------------- timm
# (family, model, image size, extra create_model arguments, note)
_TIMM = [
    ("resnet", "resnet18", 64, {}, ""),
    ("efficientnet", "efficientnet_b0", 64, {}, ""),
    ("mobilenetv3", "mobilenetv3_small_100", 64, {}, ""),
    ("convnext", "convnext_atto", 64, {}, ""),
    ("vit", "vit_tiny_patch16_224", 64, {"img_size": 64}, ""),
    ("deit", "deit_tiny_patch16_224", 64, {"img_size": 64}, ""),
    ("swin", "swin_tiny_patch4_window7_224", 224, {}, "windows of 7 at every stage: 224"),
    ("regnet", "regnetx_002", 64, {}, ""),
    ("densenet", "densenet121", 64, {}, ""),
    ("inception_v3", "inception_v3", 96, {}, "needs at least 75x75"),
    ("ghostnet", "ghostnet_100", 64, {}, ""),
    ("mlp_mixer", "mixer_s16_224", 64, {"img_size": 64}, ""),
    ("levit", "levit_128s", 64, {"img_size": 64}, ""),
    ("resnest", "resnest14d", 64, {}, ""),
    ("dla", "dla34", 64, {}, ""),
    ("hrnet", "hrnet_w18_small", 64, {}, ""),
    ("coat", "coat_lite_tiny", 64, {"img_size": 64}, ""),
    ("poolformer", "poolformer_s12", 64, {}, ""),
    ("mobilevit", "mobilevit_xxs", 64, {}, ""),
    ("cspnet", "cspdarknet53", 64, {}, ""),
    ("rexnet", "rexnet_100", 64, {}, ""),
    ("xcit", "xcit_nano_12_p16_224", 64, {"img_size": 64}, ""),
    ("cait", "cait_xxs24_224", 64, {"img_size": 64}, ""),
    ("pit", "pit_ti_224", 64, {"img_size": 64}, ""),
    ("edgenext", "edgenext_xx_small", 64, {}, ""),
    ("fastvit", "fastvit_t8", 64, {}, ""),
    ("repvgg", "repvgg_a0", 64, {}, ""),
    ("res2net", "res2net50_26w_4s", 64, {}, ""),
    ("efficientformer", "efficientformer_l1", 224, {}, "attention biases sized for 224"),
    ("beit", "beit_base_patch16_224", 64, {"img_size": 64}, ""),
    ("twins", "twins_svt_small", 64, {"img_size": 64}, ""),
    ("pvt_v2", "pvt_v2_b0", 64, {}, ""),
    ("hiera", "hiera_tiny_224", 224, {}, "mask unit sizes fixed for 224"),
]


def timm_cases() -> list[Case]:
    cases = []
    for family, model_name, size, kwargs, note in _TIMM:
        def build(model_name=model_name, kwargs=kwargs) -> nn.Module:
            import timm
            return timm.create_model(model_name, pretrained=False, **kwargs)

        extra = ", ".join(f"{k}={v}" for k, v in kwargs.items())
        text = "; ".join(p for p in (f"family {family}", extra, note, f"input Nx3x{size}x{size}") if p)
        cases.append(_image_case(f"timm/{model_name}", "timm", "classification", build, (3, size, size),
                                 note=text))
    return cases


# ---------------------------------------------------------------------------- transformers
def _text_inputs(vocab: int, seq: int, pad_id: int, eos: Optional[int] = None, low: int = 3):
    """input_ids and attention_mask as a tokenizer gives them (right padding, pad id in the pads,
    the end-of-sequence id last when the model has one: CLIP's text model pools there)."""
    def make(which: str) -> dict[str, torch.Tensor]:
        fractions = _PAD_FRACTIONS[which]
        length = 11 if which == "batch" else seq
        ids = torch.randint(low, vocab, (len(fractions), length), generator=_gen(which))
        mask = torch.zeros(len(fractions), length, dtype=torch.int64)
        for i, f in enumerate(fractions):
            n = max(1, round(f * length))
            mask[i, :n] = 1
            if eos is not None:
                ids[i, n - 1] = eos
        return {"input_ids": ids.masked_fill(mask == 0, pad_id), "attention_mask": mask}
    return make


_TEXT_DYNAMIC = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"}}

# Small dims shared by the text configs.
D, HEADS, FF, LAYERS, VOCAB, MAXPOS = 32, 4, 64, 2, 128, 64


# Special token ids inside the small vocabularies (the configs' defaults are ids of the full ones).
_SPECIAL_IDS = dict(bos_token_id=1, eos_token_id=2, pad_token_id=0, decoder_start_token_id=1)


def _hf_text(key: str, model_cls: str, config_cls: str, kind: str, pad_id: Optional[int] = 0, seq: int = 8,
             note: str = "", **cfg: Any) -> Case:
    cfg.setdefault("pad_token_id", pad_id)
    for k, v in _SPECIAL_IDS.items():
        cfg.setdefault(k, v)
    if model_cls == "ModernBertModel":
        cfg.update(cls_token_id=1, sep_token_id=2)

    def build() -> nn.Module:
        import transformers
        config = getattr(transformers, config_cls)(**cfg)
        return getattr(transformers, model_cls)(config)

    vocab = cfg.get("vocab_size", VOCAB)
    return Case(f"hf/{key}", "transformers", kind, lambda: seeded(build),
                _text_inputs(vocab, seq, cfg["pad_token_id"], eos=cfg["eos_token_id"]),
                dict(_TEXT_DYNAMIC), note=note or f"{config_cls} (small), input_ids + attention_mask (padded)",
                has_mask=True, config=cfg)


def _bert_like(**extra: Any) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                intermediate_size=FF, max_position_embeddings=MAXPOS, **extra)


def _llama_like(**extra: Any) -> dict:
    cfg = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               num_key_value_heads=2, intermediate_size=FF, max_position_embeddings=MAXPOS, use_cache=False,
               pad_token_id=0)
    cfg.update(extra)
    return cfg


def _hf_vision(key: str, model_cls: str, config_cls: str, image: int = 32, note: str = "", **cfg: Any) -> Case:
    def build() -> nn.Module:
        import transformers
        return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg))

    return _image_case(f"hf/{key}", "transformers", "vision", build, (3, image, image), input_name="pixel_values",
                       note=note or f"{config_cls} (small), pixel_values Nx3x{image}x{image}")


class WhisperEncoderOnly(nn.Module):
    """transformers' WhisperEncoder, as ``WhisperModel(config).get_encoder()`` gives it."""

    def __init__(self, config):
        super().__init__()
        import transformers
        self.encoder = transformers.WhisperModel(config).get_encoder()

    def forward(self, input_features):
        return self.encoder(input_features=input_features)


def _whisper_encoder() -> Case:
    cfg = dict(vocab_size=VOCAB, d_model=D, encoder_layers=LAYERS, encoder_attention_heads=HEADS,
               decoder_layers=1, decoder_attention_heads=HEADS, encoder_ffn_dim=FF, decoder_ffn_dim=FF,
               num_mel_bins=16, max_source_positions=16, max_target_positions=32, **_SPECIAL_IDS)

    def build() -> nn.Module:
        import transformers
        return WhisperEncoderOnly(transformers.WhisperConfig(**cfg))

    return _image_case("hf/whisper_encoder", "transformers", "audio encoder", build, (16, 32),
                       input_name="input_features",
                       note="WhisperConfig (small: 16 mel bins, 32 frames = 2 x max_source_positions), encoder only")


def _speech_inputs(samples: int):
    def make(which: str) -> dict[str, torch.Tensor]:
        fractions = _PAD_FRACTIONS[which]
        length = samples + 160 if which == "batch" else samples
        values = torch.randn(len(fractions), length, generator=_gen(which))
        mask = torch.zeros(len(fractions), length, dtype=torch.int64)
        for i, f in enumerate(fractions):
            mask[i, :max(1, round(f * length))] = 1
        return {"input_values": values * mask, "attention_mask": mask}
    return make


def _hf_speech(key: str, model_cls: str, config_cls: str) -> Case:
    cfg = dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               intermediate_size=FF, conv_dim=(16, 16, 16), conv_stride=(5, 2, 2), conv_kernel=(10, 3, 3),
               num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, feat_extract_norm="layer",
               do_stable_layer_norm=True)

    def build() -> nn.Module:
        import transformers
        return getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg))

    dyn = {"input_values": {0: "batch", 1: "samples"}, "attention_mask": {0: "batch", 1: "samples"}}
    return Case(f"hf/{key}", "transformers", "audio encoder", lambda: seeded(build), _speech_inputs(800), dyn,
                note=f"{config_cls} (small, layer-norm feature extractor, which takes attention_mask), "
                     "input_values + attention_mask (padded), N x 800 samples",
                has_mask=True, config=cfg)


def transformers_cases() -> list[Case]:
    enc, dec = "text encoder", "decoder"
    c = [
        _hf_text("bert", "BertModel", "BertConfig", enc, **_bert_like()),
        _hf_text("roberta", "RobertaModel", "RobertaConfig", enc, pad_id=1, **_bert_like(pad_token_id=1)),
        _hf_text("xlm_roberta", "XLMRobertaModel", "XLMRobertaConfig", enc, pad_id=1, **_bert_like(pad_token_id=1)),
        _hf_text("distilbert", "DistilBertModel", "DistilBertConfig", enc, vocab_size=VOCAB, dim=D, n_layers=LAYERS,
                 n_heads=HEADS, hidden_dim=FF, max_position_embeddings=MAXPOS),
        _hf_text("albert", "AlbertModel", "AlbertConfig", enc, **_bert_like(embedding_size=16)),
        _hf_text("electra", "ElectraModel", "ElectraConfig", enc, **_bert_like(embedding_size=16)),
        _hf_text("deberta", "DebertaModel", "DebertaConfig", enc, **_bert_like()),
        _hf_text("deberta_v2", "DebertaV2Model", "DebertaV2Config", enc,
                 **_bert_like(relative_attention=True, position_buckets=16, pos_att_type=["p2c", "c2p"])),
        _hf_text("mobilebert", "MobileBertModel", "MobileBertConfig", enc,
                 **_bert_like(embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16,
                              num_feedforward_networks=2)),
        _hf_text("mpnet", "MPNetModel", "MPNetConfig", enc, pad_id=1, **_bert_like(pad_token_id=1)),
        _hf_text("funnel", "FunnelModel", "FunnelConfig", enc, vocab_size=VOCAB, block_sizes=[1, 1], d_model=D,
                 n_head=HEADS, d_head=8, d_inner=FF, max_position_embeddings=MAXPOS),
        _hf_text("squeezebert", "SqueezeBertModel", "SqueezeBertConfig", enc,
                 **_bert_like(embedding_size=D, q_groups=2, k_groups=2, v_groups=2, post_attention_groups=2,
                              intermediate_groups=2, output_groups=2)),
        _hf_text("roformer", "RoFormerModel", "RoFormerConfig", enc, **_bert_like(embedding_size=D)),
        _hf_text("convbert", "ConvBertModel", "ConvBertConfig", enc, **_bert_like(embedding_size=D)),
        _hf_text("modernbert", "ModernBertModel", "ModernBertConfig", enc, vocab_size=VOCAB, hidden_size=D,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FF,
                 max_position_embeddings=MAXPOS, local_attention=4, pad_token_id=0),
        _hf_text("big_bird", "BigBirdModel", "BigBirdConfig", enc,
                 **_bert_like(attention_type="original_full"),
                 note="BigBirdConfig (small, attention_type='original_full': block-sparse needs long inputs)"),
        _hf_text("gpt2", "GPT2Model", "GPT2Config", dec, vocab_size=VOCAB, n_positions=MAXPOS, n_embd=D,
                 n_layer=LAYERS, n_head=HEADS, use_cache=False),
        _hf_text("gpt_neo", "GPTNeoModel", "GPTNeoConfig", dec, vocab_size=VOCAB, max_position_embeddings=MAXPOS,
                 hidden_size=D, num_layers=LAYERS, num_heads=HEADS, attention_types=[[["global", "local"], 1]],
                 window_size=4, intermediate_size=FF, use_cache=False),
        _hf_text("gptj", "GPTJModel", "GPTJConfig", dec, vocab_size=VOCAB, n_positions=MAXPOS, n_embd=D,
                 n_layer=LAYERS, n_head=HEADS, rotary_dim=4, use_cache=False),
        _hf_text("codegen", "CodeGenModel", "CodeGenConfig", dec, vocab_size=VOCAB, n_positions=MAXPOS, n_ctx=MAXPOS,
                 n_embd=D, n_layer=LAYERS, n_head=HEADS, rotary_dim=4, use_cache=False),
        _hf_text("gpt_bigcode", "GPTBigCodeModel", "GPTBigCodeConfig", dec, vocab_size=VOCAB, n_positions=MAXPOS,
                 n_embd=D, n_layer=LAYERS, n_head=HEADS, multi_query=True, use_cache=False),
        _hf_text("opt", "OPTModel", "OPTConfig", dec, pad_id=1, vocab_size=VOCAB, hidden_size=D,
                 num_hidden_layers=LAYERS, ffn_dim=FF, num_attention_heads=HEADS, max_position_embeddings=MAXPOS,
                 word_embed_proj_dim=D, use_cache=False, pad_token_id=1),
        _hf_text("bloom", "BloomModel", "BloomConfig", dec, vocab_size=VOCAB, hidden_size=D, n_layer=LAYERS,
                 n_head=HEADS, use_cache=False),
        _hf_text("llama", "LlamaModel", "LlamaConfig", dec, **_llama_like()),
        _hf_text("mistral", "MistralModel", "MistralConfig", dec, **_llama_like(sliding_window=None)),
        _hf_text("qwen2", "Qwen2Model", "Qwen2Config", dec, **_llama_like()),
        _hf_text("qwen3", "Qwen3Model", "Qwen3Config", dec, **_llama_like(head_dim=8)),
        _hf_text("gemma", "GemmaModel", "GemmaConfig", dec, **_llama_like(head_dim=8)),
        _hf_text("gemma2", "Gemma2Model", "Gemma2Config", dec, **_llama_like(head_dim=8, sliding_window=4)),
        _hf_text("phi", "PhiModel", "PhiConfig", dec, **_llama_like(partial_rotary_factor=0.5)),
        _hf_text("phi3", "Phi3Model", "Phi3Config", dec, **_llama_like(num_key_value_heads=HEADS)),
        _hf_text("stablelm", "StableLmModel", "StableLmConfig", dec, **_llama_like()),
        _hf_text("olmo", "OlmoModel", "OlmoConfig", dec, **_llama_like()),
        _hf_text("granite", "GraniteModel", "GraniteConfig", dec, **_llama_like()),
        _hf_text("falcon", "FalconModel", "FalconConfig", dec, vocab_size=VOCAB, hidden_size=D,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, new_decoder_architecture=False,
                 multi_query=True, alibi=False, use_cache=False, pad_token_id=0),
        _hf_text("t5_encoder", "T5EncoderModel", "T5Config", enc, vocab_size=VOCAB, d_model=D, d_kv=8, d_ff=FF,
                 num_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8, use_cache=False),
        _hf_text("mt5_encoder", "MT5EncoderModel", "MT5Config", enc, vocab_size=VOCAB, d_model=D, d_kv=8, d_ff=FF,
                 num_layers=LAYERS, num_heads=HEADS, relative_attention_num_buckets=8, use_cache=False),
        _hf_text("bart", "BartModel", "BartConfig", "encoder-decoder", pad_id=1, vocab_size=VOCAB, d_model=D,
                 encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=HEADS,
                 decoder_attention_heads=HEADS, encoder_ffn_dim=FF, decoder_ffn_dim=FF,
                 max_position_embeddings=MAXPOS, use_cache=False, pad_token_id=1,
                 note="BartConfig (small), input_ids + attention_mask (padded); the decoder input is "
                      "input_ids shifted right, as BartModel does when it is not given"),
        _hf_text("clip_text", "CLIPTextModel", "CLIPTextConfig", enc, pad_id=1, vocab_size=VOCAB, hidden_size=D,
                 num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FF,
                 max_position_embeddings=MAXPOS, pad_token_id=1, eos_token_id=2),
        _whisper_encoder(),
        _hf_speech("wav2vec2", "Wav2Vec2Model", "Wav2Vec2Config"),
        _hf_speech("hubert", "HubertModel", "HubertConfig"),
        _hf_vision("vit", "ViTModel", "ViTConfig", image_size=32, patch_size=8, **_bert_like()),
        _hf_vision("deit", "DeiTModel", "DeiTConfig", image_size=32, patch_size=8, **_bert_like()),
        _hf_vision("beit", "BeitModel", "BeitConfig", image_size=32, patch_size=8,
                   use_relative_position_bias=True, **_bert_like()),
        _hf_vision("dinov2", "Dinov2Model", "Dinov2Config", image_size=32, patch_size=8, hidden_size=D,
                   num_hidden_layers=LAYERS, num_attention_heads=HEADS, mlp_ratio=2),
        _hf_vision("clip_vision", "CLIPVisionModel", "CLIPVisionConfig", image_size=32, patch_size=8, hidden_size=D,
                   num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FF),
        _hf_vision("swin", "SwinModel", "SwinConfig", image_size=32, patch_size=2, embed_dim=16, depths=[1, 1],
                   num_heads=[2, 2], window_size=4),
        _hf_vision("convnext", "ConvNextModel", "ConvNextConfig", hidden_sizes=[8, 16], depths=[1, 1], num_stages=2),
        _hf_vision("resnet", "ResNetModel", "ResNetConfig", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1]),
        _hf_vision("segformer", "SegformerModel", "SegformerConfig", num_encoder_blocks=2, depths=[1, 1],
                   sr_ratios=[2, 1], hidden_sizes=[8, 16], patch_sizes=[7, 3], strides=[4, 2],
                   num_attention_heads=[1, 2], mlp_ratios=[2, 2]),
        _hf_vision("mobilevit", "MobileViTModel", "MobileViTConfig", image=64, image_size=64,
                   hidden_sizes=[16, 24, 32], neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 48]),
    ]
    return c


# ---------------------------------------------------------------------------- torch.nn's own layers
class LSTMClassifier(nn.Module):
    """Embedding -> 2-layer bidirectional LSTM (batch first) -> mean over time -> Linear."""

    def __init__(self, vocab: int = VOCAB, d: int = D, classes: int = 5):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, num_layers=2, batch_first=True, bidirectional=True)
        self.head = nn.Linear(2 * d, classes)

    def forward(self, input_ids):
        out, _ = self.lstm(self.embed(input_ids))
        return self.head(out.mean(1))


class GRUTagger(nn.Module):
    """Embedding -> GRU (sequence first) -> Linear per step."""

    def __init__(self, vocab: int = VOCAB, d: int = D, tags: int = 7):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.gru = nn.GRU(d, d)
        self.head = nn.Linear(d, tags)

    def forward(self, input_ids):
        out, _ = self.gru(self.embed(input_ids).transpose(0, 1))
        return self.head(out.transpose(0, 1))


class PaddedTransformerEncoder(nn.Module):
    """nn.TransformerEncoder with a key padding mask from the attention mask."""

    def __init__(self, vocab: int = VOCAB, d: int = D):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, HEADS, FF, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, LAYERS, enable_nested_tensor=False)

    def forward(self, input_ids, attention_mask):
        return self.encoder(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)


class Seq2SeqTransformer(nn.Module):
    """nn.Transformer (encoder + decoder, causal target mask) on one token sequence."""

    def __init__(self, vocab: int = VOCAB, d: int = D):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.model = nn.Transformer(d, HEADS, LAYERS, LAYERS, FF, dropout=0.1, batch_first=True)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        t = input_ids.size(1)
        causal = nn.Transformer.generate_square_subsequent_mask(t)
        pad = attention_mask == 0
        return self.model(x, x, tgt_mask=causal, src_key_padding_mask=pad, tgt_key_padding_mask=pad,
                          memory_key_padding_mask=pad)


def _torch_text(name: str, cls: type, mask: bool, kind: str, note: str) -> Case:
    make = _text_inputs(VOCAB, 8, 0)

    def inputs(which: str) -> dict[str, torch.Tensor]:
        out = make(which)
        return out if mask else {"input_ids": out["input_ids"]}

    dyn = dict(_TEXT_DYNAMIC) if mask else {"input_ids": {0: "batch", 1: "seq"}}
    return Case(f"torch/{name}", "torch", kind,
                lambda: seeded(cls), inputs, dyn, note=note, has_mask=mask)


def torch_cases() -> list[Case]:
    return [
        _torch_text("lstm_classifier", LSTMClassifier, False, "recurrent",
                    "nn.LSTM (2 layers, bidirectional, batch first), input_ids N x seq"),
        _torch_text("gru_tagger", GRUTagger, False, "recurrent", "nn.GRU (sequence first), input_ids N x seq"),
        _torch_text("transformer_encoder", PaddedTransformerEncoder, True, "transformer",
                    "nn.TransformerEncoder with src_key_padding_mask from a padded attention mask"),
        _torch_text("transformer", Seq2SeqTransformer, True, "transformer",
                    "nn.Transformer (causal target mask, key padding masks from a padded attention mask)"),
    ]


# ---------------------------------------------------------------------------- the suite
FAMILIES = ("torchvision", "timm", "transformers", "torch")
_BUILDERS = {"torchvision": torchvision_cases, "timm": timm_cases, "transformers": transformers_cases,
             "torch": torch_cases}

# The CI subset (tests/test_model_suite.py, `model_suite.py --subset ci`): one model of each kind.
CI_SUBSET = ("resnet18", "mobilenet_v3_small", "efficientnet_b0", "vit_b_16", "deeplabv3_mobilenet_v3_large",
             "r3d_18", "timm/convnext_atto", "hf/bert", "hf/gpt2", "hf/t5_encoder", "torch/lstm_classifier")


def all_cases(families: tuple[str, ...] = FAMILIES) -> list[Case]:
    """Every case of the given families (a family whose package is missing is left out)."""
    import importlib.util

    need = {"torchvision": "torchvision", "timm": "timm", "transformers": "transformers", "torch": "torch"}
    cases: list[Case] = []
    for fam in families:
        if importlib.util.find_spec(need[fam]) is None:
            continue
        cases += _BUILDERS[fam]()
    names = [c.name for c in cases]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise ValueError(f"duplicate suite names: {sorted(dup)}")
    return cases


def by_name(name: str) -> Case:
    family = ("timm" if name.startswith("timm/") else "transformers" if name.startswith("hf/")
              else "torch" if name.startswith("torch/") else "torchvision")
    for c in _BUILDERS[family]():
        if c.name == name:
            return c
    raise KeyError(f"no suite model named {name!r}")
