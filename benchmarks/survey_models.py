"""The model survey's zoo (`benchmarks/model_survey.py`): models built from the libraries' real classes
(transformers, torch_geometric, torch.nn), small configs with random weights, nothing downloaded. Each builder
returns (model, args, kwargs, loss_fn), seeded, in train mode; `MODELS` maps its name to it, in the order below.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

B, S, V = 2, 16, 64
DROP = 0.1

MODELS: dict = {}


def model(builder):
    """Register a builder in MODELS under its name."""
    MODELS[builder.__name__] = builder
    return builder


def hf_loss(output, inputs):
    return output["loss"]


def _ids(seed=1, batch=B, seq=S, vocab=V, low=0):
    return torch.randint(low, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def _padded_mask(batch=B, seq=S, pad=3):
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[-1, seq - pad:] = 0
    return mask


def _hf(cls, cfg, eager=True):
    torch.manual_seed(0)
    model = cls._from_config(cfg, attn_implementation="eager") if eager else cls._from_config(cfg)
    return model.train()


def _causal_lm(cls, cfg, mask=True):
    model = _hf(cls, cfg)
    ids = _ids()
    kwargs = {"input_ids": ids, "labels": ids}
    if mask:
        kwargs["attention_mask"] = _padded_mask()
        kwargs["labels"] = ids.masked_fill(kwargs["attention_mask"] == 0, -100)
    return model, (), kwargs, hf_loss


# ---------------------------------------------------------------- decoders

@model
def mistral():
    from transformers import MistralConfig, MistralForCausalLM
    cfg = MistralConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                        attention_dropout=DROP, sliding_window=8)
    return _causal_lm(MistralForCausalLM, cfg)


@model
def phi():
    from transformers import PhiConfig, PhiForCausalLM
    cfg = PhiConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=64, use_cache=False, resid_pdrop=DROP, embd_pdrop=DROP,
                    attention_dropout=DROP, partial_rotary_factor=0.5)
    return _causal_lm(PhiForCausalLM, cfg)


@model
def gemma():
    from transformers import GemmaConfig, GemmaForCausalLM
    cfg = GemmaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=8, max_position_embeddings=64, use_cache=False,
                      attention_dropout=DROP)
    return _causal_lm(GemmaForCausalLM, cfg)


@model
def gemma2():
    from transformers import Gemma2Config, Gemma2ForCausalLM
    cfg = Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                       use_cache=False, attention_dropout=DROP, sliding_window=8)
    return _causal_lm(Gemma2ForCausalLM, cfg)


@model
def gpt_neox():
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM
    cfg = GPTNeoXConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, use_cache=False, rotary_pct=0.5,
                        hidden_dropout=DROP, attention_dropout=DROP)
    return _causal_lm(GPTNeoXForCausalLM, cfg)


@model
def opt():
    from transformers import OPTConfig, OPTForCausalLM
    cfg = OPTConfig(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                    max_position_embeddings=64, word_embed_proj_dim=32, use_cache=False, dropout=DROP,
                    attention_dropout=DROP, activation_dropout=DROP, pad_token_id=1, bos_token_id=2, eos_token_id=2)
    return _causal_lm(OPTForCausalLM, cfg)


@model
def falcon():
    from transformers import FalconConfig, FalconForCausalLM
    cfg = FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, use_cache=False,
                       hidden_dropout=DROP, attention_dropout=DROP, alibi=False, new_decoder_architecture=False,
                       multi_query=True, parallel_attn=True, bias=False, max_position_embeddings=64)
    return _causal_lm(FalconForCausalLM, cfg)


@model
def bloom():
    from transformers import BloomConfig, BloomForCausalLM
    cfg = BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4, use_cache=False, hidden_dropout=DROP,
                      attention_dropout=DROP)
    return _causal_lm(BloomForCausalLM, cfg)


# ---------------------------------------------------------------- encoders

@model
def bloom_plain_gelu():
    """BloomForCausalLM with its MLP's custom autograd GeLUFunction replaced by the same forward formula
    (`bloom_gelu_forward`): autograd's derivative in the model too, as in the captured graph."""
    from transformers.models.bloom import modeling_bloom
    model, args, kwargs, loss_fn = bloom()
    for module in model.modules():
        if isinstance(module, modeling_bloom.BloomGelu):
            module.forward = modeling_bloom.bloom_gelu_forward
    return model, args, kwargs, loss_fn


@model
def distilbert():
    from transformers import DistilBertConfig, DistilBertForSequenceClassification
    cfg = DistilBertConfig(vocab_size=V, dim=32, hidden_dim=64, n_layers=2, n_heads=4, max_position_embeddings=64,
                           dropout=DROP, attention_dropout=DROP, seq_classif_dropout=DROP, num_labels=3,
                           pad_token_id=0)
    model = _hf(DistilBertForSequenceClassification, cfg)
    return model, (), {"input_ids": _ids(), "attention_mask": _padded_mask(), "labels": torch.tensor([0, 2])}, \
        hf_loss


@model
def roberta():
    from transformers import RobertaConfig, RobertaForMaskedLM
    cfg = RobertaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=DROP,
                        attention_probs_dropout_prob=DROP, pad_token_id=1, type_vocab_size=1)
    model = _hf(RobertaForMaskedLM, cfg)
    ids = _ids(low=3)
    mask = _padded_mask()
    ids = ids.masked_fill(mask == 0, 1)
    labels = torch.full_like(ids, -100)
    labels[:, 2:6] = ids[:, 2:6]
    return model, (), {"input_ids": ids, "attention_mask": mask, "labels": labels}, hf_loss


@model
def deberta_v2():
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification
    cfg = DebertaV2Config(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=DROP,
                          attention_probs_dropout_prob=DROP, relative_attention=True, position_buckets=8,
                          max_relative_positions=16, pos_att_type=["p2c", "c2p"], num_labels=3, pooler_dropout=DROP,
                          pooler_hidden_size=32, type_vocab_size=0,
                          problem_type="single_label_classification")
    model = _hf(DebertaV2ForSequenceClassification, cfg, eager=False)
    return model, (), {"input_ids": _ids(), "attention_mask": _padded_mask(), "labels": torch.tensor([1, 2])}, \
        hf_loss


@model
def albert():
    from transformers import AlbertConfig, AlbertForMaskedLM
    cfg = AlbertConfig(vocab_size=V, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=DROP,
                       attention_probs_dropout_prob=DROP, classifier_dropout_prob=DROP, pad_token_id=0)
    model = _hf(AlbertForMaskedLM, cfg)
    ids = _ids(low=3)
    labels = torch.full_like(ids, -100)
    labels[:, 2:6] = ids[:, 2:6]
    return model, (), {"input_ids": ids, "attention_mask": _padded_mask(), "labels": labels}, hf_loss


@model
def bart():
    from transformers import BartConfig, BartForConditionalGeneration
    cfg = BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                     dropout=DROP, attention_dropout=DROP, activation_dropout=DROP, use_cache=False,
                     pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                     forced_eos_token_id=None)
    model = _hf(BartForConditionalGeneration, cfg)
    ids = _ids(low=3)
    return model, (), {"input_ids": ids, "attention_mask": _padded_mask(),
                       "labels": _ids(seed=2, seq=8, low=3)}, hf_loss


# ---------------------------------------------------------------- vision / speech / multimodal

def _pixels(seed=1, size=32):
    return torch.randn(B, 3, size, size, generator=torch.Generator().manual_seed(seed))


@model
def convnext():
    from transformers import ConvNextConfig, ConvNextForImageClassification
    cfg = ConvNextConfig(num_channels=3, patch_size=4, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                         drop_path_rate=DROP, num_labels=5, image_size=32)
    model = _hf(ConvNextForImageClassification, cfg, eager=False)
    return model, (), {"pixel_values": _pixels(), "labels": torch.tensor([1, 3])}, hf_loss


@model
def swin():
    from transformers import SwinConfig, SwinForImageClassification
    cfg = SwinConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                     window_size=4, mlp_ratio=2.0, hidden_dropout_prob=DROP, attention_probs_dropout_prob=DROP,
                     drop_path_rate=DROP, num_labels=5)
    model = _hf(SwinForImageClassification, cfg)
    return model, (), {"pixel_values": _pixels(), "labels": torch.tensor([1, 3])}, hf_loss


@model
def mobilenet_v2():
    from transformers import MobileNetV2Config, MobileNetV2ForImageClassification
    cfg = MobileNetV2Config(num_channels=3, image_size=32, depth_multiplier=0.25, classifier_dropout_prob=DROP,
                            num_labels=5, min_depth=4)
    model = _hf(MobileNetV2ForImageClassification, cfg, eager=False)
    return model, (), {"pixel_values": _pixels(), "labels": torch.tensor([1, 3])}, hf_loss


@model
def wav2vec2_ctc():
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC
    cfg = Wav2Vec2Config(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                         conv_bias=False, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                         hidden_dropout=DROP, attention_dropout=DROP, activation_dropout=DROP, feat_proj_dropout=DROP,
                         final_dropout=DROP, layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0,
                         feat_extract_norm="group", do_stable_layer_norm=False, pad_token_id=0,
                         ctc_loss_reduction="mean")
    model = _hf(Wav2Vec2ForCTC, cfg)
    audio = torch.randn(B, 400, generator=torch.Generator().manual_seed(1))
    labels = torch.randint(1, 16, (B, 6), generator=torch.Generator().manual_seed(2))

    def ctc_loss(output, inputs):
        """The CTC loss Wav2Vec2ForCTC computes from `labels` (every frame and label valid), outside the model: its
        `labels.max() >= vocab_size` check is data-dependent and does not capture."""
        log_probs = F.log_softmax(output["logits"], dim=-1, dtype=torch.float32).transpose(0, 1)
        frames = torch.full((B,), log_probs.shape[0], dtype=torch.long)
        lengths = torch.full((B,), labels.shape[1], dtype=torch.long)
        return F.ctc_loss(log_probs, labels, frames, lengths, blank=0, reduction="mean", zero_infinity=False)
    return model, (), {"input_values": audio}, ctc_loss


@model
def wav2vec2():
    """Wav2Vec2ForCTC's logits with a frame-level cross-entropy (the frame-classification form of the same model;
    `wav2vec2_ctc` is its CTC fine-tuning)."""
    model, args, kwargs, _ = wav2vec2_ctc()
    frames = torch.randint(0, 16, (B, 39), generator=torch.Generator().manual_seed(3))

    def frame_loss(output, inputs):
        logits = output["logits"]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), frames[:, :logits.shape[1]].reshape(-1))
    return model, args, kwargs, frame_loss


@model
def clip():
    from transformers import CLIPConfig, CLIPModel
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=S, attention_dropout=DROP, projection_dim=16, eos_token_id=2, bos_token_id=0, pad_token_id=1)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8, attention_dropout=DROP, projection_dim=16)
    cfg = CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)
    model = _hf(CLIPModel, cfg)
    ids = _ids(low=3)
    ids[:, -1] = 2
    return model, (), {"input_ids": ids, "pixel_values": _pixels(), "attention_mask": torch.ones_like(ids),
                       "return_loss": True}, hf_loss


# ---------------------------------------------------------------- PyG

NODES, EDGES, FEATS, CLASSES = 24, 64, 8, 3


def _graph():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(NODES, FEATS, generator=g)
    edge_index = torch.randint(0, NODES, (2, EDGES), generator=g)
    y = torch.randint(0, CLASSES, (NODES,), generator=g)
    return x, edge_index, y


def _node_loss(y):
    def loss_fn(output, inputs):
        return F.cross_entropy(output, y)
    return loss_fn


@model
def pyg_gcn_bn():
    """torch_geometric.nn.models.GCN, 2 layers, batch norm, dropout 0.1."""
    from torch_geometric.nn.models import GCN
    torch.manual_seed(0)
    x, ei, y = _graph()
    model = GCN(FEATS, 32, num_layers=2, out_channels=CLASSES, dropout=DROP, norm="batch_norm").train()
    return model, (x, ei), {}, _node_loss(y)


class _UNetNodes(nn.Module):
    def __init__(self):
        super().__init__()
        from torch_geometric.nn.models import GraphUNet
        self.net = GraphUNet(FEATS, 32, CLASSES, depth=2, pool_ratios=0.5)

    def forward(self, x, edge_index):
        return self.net(x, edge_index)


@model
def pyg_graph_unet():
    torch.manual_seed(0)
    x, ei, y = _graph()
    return _UNetNodes().train(), (x, ei), {}, _node_loss(y)


@model
def pyg_gat_jk():
    """torch_geometric.nn.models.GAT, 2 layers, 2 heads, jumping knowledge 'cat', dropout 0.1."""
    from torch_geometric.nn.models import GAT
    torch.manual_seed(0)
    x, ei, y = _graph()
    model = GAT(FEATS, 32, num_layers=2, out_channels=CLASSES, dropout=DROP, heads=2, jk="cat").train()
    return model, (x, ei), {}, _node_loss(y)


@model
def pyg_gat_jk_lstm():
    from torch_geometric.nn.models import GAT
    torch.manual_seed(0)
    x, ei, y = _graph()
    model = GAT(FEATS, 32, num_layers=2, out_channels=CLASSES, dropout=DROP, heads=2, jk="max").train()
    return model, (x, ei), {}, _node_loss(y)


# ---------------------------------------------------------------- extras (beyond the brief's list)

def _img_cls(cls, cfg, size=32, eager=True):
    model = _hf(cls, cfg, eager=eager)
    return model, (), {"pixel_values": _pixels(size=size), "labels": torch.tensor([1, 3])}, hf_loss


@model
def efficientnet():
    from transformers import EfficientNetConfig, EfficientNetForImageClassification
    cfg = EfficientNetConfig(image_size=32, width_coefficient=0.25, depth_coefficient=0.25, hidden_dim=320,
                             dropout_rate=DROP, drop_connect_rate=DROP, num_labels=5)
    return _img_cls(EfficientNetForImageClassification, cfg, eager=False)


@model
def poolformer():
    from transformers import PoolFormerConfig, PoolFormerForImageClassification
    cfg = PoolFormerConfig(num_channels=3, patch_size=7, stride=4, hidden_sizes=[16, 32], depths=[1, 1],
                           num_encoder_blocks=2, patch_sizes=[7, 3], strides=[4, 2], padding=[2, 1], pool_size=3,
                           mlp_ratio=2.0, drop_path_rate=DROP, hidden_dropout_prob=DROP, num_labels=5)
    return _img_cls(PoolFormerForImageClassification, cfg, eager=False)


@model
def segformer():
    from transformers import SegformerConfig, SegformerForSemanticSegmentation
    cfg = SegformerConfig(num_channels=3, num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                          patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                          hidden_dropout_prob=DROP, attention_probs_dropout_prob=DROP, classifier_dropout_prob=DROP,
                          drop_path_rate=DROP, decoder_hidden_size=32, num_labels=4, semantic_loss_ignore_index=255)
    model = _hf(SegformerForSemanticSegmentation, cfg)
    labels = torch.randint(0, 4, (B, 32, 32), generator=torch.Generator().manual_seed(2))
    return model, (), {"pixel_values": _pixels(), "labels": labels}, hf_loss


@model
def dinov2():
    from transformers import Dinov2Config, Dinov2ForImageClassification
    cfg = Dinov2Config(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       mlp_ratio=2, hidden_dropout_prob=DROP, attention_probs_dropout_prob=DROP, drop_path_rate=DROP,
                       layerscale_value=1.0, num_labels=5)
    return _img_cls(Dinov2ForImageClassification, cfg)


@model
def beit():
    from transformers import BeitConfig, BeitForImageClassification
    cfg = BeitConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, hidden_dropout_prob=DROP, attention_probs_dropout_prob=DROP,
                     drop_path_rate=DROP, use_relative_position_bias=True, layer_scale_init_value=0.1,
                     use_mean_pooling=True, num_labels=5, vocab_size=64)
    return _img_cls(BeitForImageClassification, cfg)


@model
def levit():
    from transformers import LevitConfig, LevitForImageClassification
    cfg = LevitConfig(image_size=32, num_channels=3, kernel_size=3, stride=2, padding=1, patch_size=16,
                      hidden_sizes=[32, 48, 64], num_attention_heads=[2, 3, 4], depths=[1, 1, 1],
                      key_dim=[8, 8, 8], drop_path_rate=0, mlp_ratio=[2, 2, 2], attention_ratio=[2, 2, 2],
                      num_labels=5)
    return _img_cls(LevitForImageClassification, cfg, eager=False)


@model
def mobilevit():
    from transformers import MobileViTConfig, MobileViTForImageClassification
    cfg = MobileViTConfig(num_channels=3, image_size=32, patch_size=2, hidden_sizes=[16, 24, 32],
                          neck_hidden_sizes=[8, 8, 16, 16, 24, 24, 32], num_attention_heads=2, mlp_ratio=2.0,
                          expand_ratio=2.0, hidden_dropout_prob=DROP, attention_probs_dropout_prob=DROP,
                          classifier_dropout_prob=DROP, num_labels=5)
    return _img_cls(MobileViTForImageClassification, cfg)


@model
def regnet():
    from transformers import RegNetConfig, RegNetForImageClassification
    cfg = RegNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], groups_width=4,
                       layer_type="y", num_labels=5)
    return _img_cls(RegNetForImageClassification, cfg, eager=False)


@model
def gptj():
    from transformers import GPTJConfig, GPTJForCausalLM
    cfg = GPTJConfig(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, use_cache=False,
                     resid_pdrop=DROP, embd_pdrop=DROP, attn_pdrop=DROP, bos_token_id=0, eos_token_id=0)
    return _causal_lm(GPTJForCausalLM, cfg)


@model
def persimmon():
    from transformers import PersimmonConfig, PersimmonForCausalLM
    cfg = PersimmonConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=64, use_cache=False, qk_layernorm=True,
                          hidden_dropout=DROP, attention_dropout=DROP, partial_rotary_factor=0.5, bos_token_id=0,
                          eos_token_id=0, pad_token_id=None)
    return _causal_lm(PersimmonForCausalLM, cfg)


@model
def convbert():
    from transformers import ConvBertConfig, ConvBertForMaskedLM
    cfg = ConvBertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=DROP,
                         attention_probs_dropout_prob=DROP, embedding_size=32, head_ratio=2, conv_kernel_size=3,
                         num_groups=1, pad_token_id=0)
    model = _hf(ConvBertForMaskedLM, cfg)
    ids = _ids(low=3)
    labels = torch.full_like(ids, -100)
    labels[:, 2:6] = ids[:, 2:6]
    return model, (), {"input_ids": ids, "attention_mask": _padded_mask(), "labels": labels}, hf_loss


@model
def fnet():
    from transformers import FNetConfig, FNetForSequenceClassification
    cfg = FNetConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, intermediate_size=64,
                     max_position_embeddings=64, hidden_dropout_prob=DROP, use_tpu_fourier_optimizations=False,
                     num_labels=3, pad_token_id=0, type_vocab_size=2)
    model = _hf(FNetForSequenceClassification, cfg, eager=False)
    return model, (), {"input_ids": _ids(), "labels": torch.tensor([0, 2])}, hf_loss


@model
def xlnet():
    from transformers import XLNetConfig, XLNetLMHeadModel
    cfg = XLNetConfig(vocab_size=V, d_model=32, n_layer=2, n_head=4, d_inner=64, dropout=DROP, use_mems_train=False,
                      mem_len=None, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    model = _hf(XLNetLMHeadModel, cfg, eager=False)
    ids = _ids(low=3)
    return model, (), {"input_ids": ids, "labels": ids, "use_cache": False}, hf_loss


@model
def funnel():
    from transformers import FunnelConfig, FunnelForSequenceClassification
    cfg = FunnelConfig(vocab_size=V, block_sizes=[1, 1], block_repeats=None, num_decoder_layers=1, d_model=32,
                       n_head=4, d_head=8, d_inner=64, hidden_dropout=DROP, attention_dropout=DROP,
                       activation_dropout=DROP, max_position_embeddings=64, num_labels=3, pad_token_id=0)
    model = _hf(FunnelForSequenceClassification, cfg, eager=False)
    return model, (), {"input_ids": _ids(), "attention_mask": _padded_mask(), "labels": torch.tensor([0, 2])}, \
        hf_loss


@model
def hubert():
    from transformers import HubertConfig, HubertForSequenceClassification
    cfg = HubertConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                       conv_bias=False, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                       hidden_dropout=DROP, attention_dropout=DROP, activation_dropout=DROP, feat_proj_dropout=DROP,
                       layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0, feat_extract_norm="layer",
                       do_stable_layer_norm=True, num_labels=3, classifier_proj_size=16)
    model = _hf(HubertForSequenceClassification, cfg)
    audio = torch.randn(B, 400, generator=torch.Generator().manual_seed(1))
    return model, (), {"input_values": audio, "labels": torch.tensor([0, 2])}, hf_loss


@model
def pyg_gin_bn():
    """torch_geometric.nn.models.GIN (MLPs with batch norm), 2 layers, dropout, jumping knowledge 'last'."""
    from torch_geometric.nn.models import GIN
    torch.manual_seed(0)
    x, ei, y = _graph()
    model = GIN(FEATS, 32, num_layers=2, out_channels=CLASSES, dropout=DROP, norm="batch_norm").train()
    return model, (x, ei), {}, _node_loss(y)


@model
def pyg_sage_jk_lstm():
    from torch_geometric.nn.models import GraphSAGE
    torch.manual_seed(0)
    x, ei, y = _graph()
    model = GraphSAGE(FEATS, 32, num_layers=2, out_channels=CLASSES, dropout=DROP, jk="lstm",
                      norm="layer_norm").train()
    return model, (x, ei), {}, _node_loss(y)


@model
def pyg_gcn_groupnorm():
    from torch_geometric.nn.models import GCN
    torch.manual_seed(0)
    x, ei, y = _graph()
    model = GCN(FEATS, 32, num_layers=2, out_channels=CLASSES, dropout=DROP, norm="graph_norm").train()
    return model, (x, ei), {}, _node_loss(y)


# ---------------------------------------------------------------- more extras

@model
def convnextv2():
    from transformers import ConvNextV2Config, ConvNextV2ForImageClassification
    cfg = ConvNextV2Config(num_channels=3, patch_size=4, hidden_sizes=[16, 32], depths=[1, 1], num_stages=2,
                           drop_path_rate=DROP, num_labels=5, image_size=32)
    return _img_cls(ConvNextV2ForImageClassification, cfg, eager=False)


@model
def bit():
    from transformers import BitConfig, BitForImageClassification
    cfg = BitConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_groups=4,
                    layer_type="preactivation", global_padding="SAME", drop_path_rate=DROP, num_labels=5,
                    out_features=None)
    return _img_cls(BitForImageClassification, cfg, eager=False)


@model
def cvt():
    from transformers import CvtConfig, CvtForImageClassification
    cfg = CvtConfig(num_channels=3, patch_sizes=[7, 3, 3], patch_stride=[4, 2, 2], patch_padding=[2, 1, 1],
                    embed_dim=[16, 16, 32], num_heads=[1, 1, 2], depth=[1, 2, 3], mlp_ratio=[2.0, 2.0, 2.0],
                    attention_drop_rate=[DROP] * 3, drop_rate=[DROP] * 3, drop_path_rate=[0.0, DROP, DROP],
                    qkv_bias=[True] * 3, cls_token=[False, False, True], qkv_projection_method=["dw_bn"] * 3,
                    kernel_qkv=[3] * 3, padding_kv=[1] * 3, stride_kv=[2] * 3, padding_q=[1] * 3, stride_q=[1] * 3,
                    num_labels=5)
    return _img_cls(CvtForImageClassification, cfg, eager=False)


@model
def focalnet():
    from transformers import FocalNetConfig, FocalNetForImageClassification
    cfg = FocalNetConfig(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1],
                         focal_levels=[2, 2], focal_windows=[3, 3], mlp_ratio=2.0, hidden_dropout_prob=DROP,
                         drop_path_rate=DROP, use_layerscale=True, num_labels=5)
    return _img_cls(FocalNetForImageClassification, cfg, eager=False)


@model
def wavlm():
    from transformers import WavLMConfig, WavLMForSequenceClassification
    cfg = WavLMConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                      conv_bias=False, num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4,
                      hidden_dropout=DROP, attention_dropout=DROP, activation_dropout=DROP, feat_proj_dropout=DROP,
                      layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0, feat_extract_norm="layer",
                      do_stable_layer_norm=True, num_buckets=32, max_bucket_distance=64, num_labels=3,
                      classifier_proj_size=16)
    model = _hf(WavLMForSequenceClassification, cfg, eager=False)
    audio = torch.randn(B, 400, generator=torch.Generator().manual_seed(1))
    return model, (), {"input_values": audio, "labels": torch.tensor([0, 2])}, hf_loss


@model
def sew():
    from transformers import SEWConfig, SEWForSequenceClassification
    cfg = SEWConfig(vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    squeeze_factor=2, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), conv_bias=False,
                    num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, hidden_dropout=DROP,
                    attention_dropout=DROP, activation_dropout=DROP, feat_proj_dropout=DROP, layerdrop=0.0,
                    mask_time_prob=0.0, mask_feature_prob=0.0, feat_extract_norm="group", num_labels=3,
                    classifier_proj_size=16)
    model = _hf(SEWForSequenceClassification, cfg)
    audio = torch.randn(B, 400, generator=torch.Generator().manual_seed(1))
    return model, (), {"input_values": audio, "labels": torch.tensor([0, 2])}, hf_loss


@model
def electra():
    from transformers import ElectraConfig, ElectraForPreTraining
    cfg = ElectraConfig(vocab_size=V, embedding_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=DROP,
                        attention_probs_dropout_prob=DROP, pad_token_id=0)
    model = _hf(ElectraForPreTraining, cfg)
    labels = torch.randint(0, 2, (B, S), generator=torch.Generator().manual_seed(2))
    return model, (), {"input_ids": _ids(low=3), "attention_mask": _padded_mask(), "labels": labels}, hf_loss


@model
def mpnet():
    from transformers import MPNetConfig, MPNetForMaskedLM
    cfg = MPNetConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=DROP,
                      attention_probs_dropout_prob=DROP, pad_token_id=1)
    model = _hf(MPNetForMaskedLM, cfg, eager=False)
    ids = _ids(low=3)
    labels = torch.full_like(ids, -100)
    labels[:, 2:6] = ids[:, 2:6]
    return model, (), {"input_ids": ids, "attention_mask": _padded_mask(), "labels": labels}, hf_loss


@model
def esm():
    from transformers import EsmConfig, EsmForMaskedLM
    cfg = EsmConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    max_position_embeddings=64, hidden_dropout_prob=DROP, attention_probs_dropout_prob=DROP,
                    position_embedding_type="rotary", pad_token_id=1, mask_token_id=2, token_dropout=False,
                    emb_layer_norm_before=True)
    model = _hf(EsmForMaskedLM, cfg)
    ids = _ids(low=3)
    labels = torch.full_like(ids, -100)
    labels[:, 2:6] = ids[:, 2:6]
    return model, (), {"input_ids": ids, "attention_mask": _padded_mask(), "labels": labels}, hf_loss


@model
def qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, max_position_embeddings=64, use_cache=False,
                      attention_dropout=DROP)
    return _causal_lm(Qwen3ForCausalLM, cfg)


@model
def phi3():
    from transformers import Phi3Config, Phi3ForCausalLM
    cfg = Phi3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64, use_cache=False, resid_pdrop=DROP,
                     embd_pdrop=DROP, attention_dropout=DROP, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _causal_lm(Phi3ForCausalLM, cfg)


@model
def cohere():
    from transformers import CohereConfig, CohereForCausalLM
    cfg = CohereConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=64, use_cache=False, attention_dropout=DROP,
                       use_qk_norm=True, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _causal_lm(CohereForCausalLM, cfg)


@model
def olmo2():
    from transformers import Olmo2Config, Olmo2ForCausalLM
    cfg = Olmo2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, use_cache=False, attention_dropout=DROP,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _causal_lm(Olmo2ForCausalLM, cfg)


@model
def qwen2_moe():
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM
    cfg = Qwen2MoeConfig(vocab_size=V, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                         shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, use_cache=False, attention_dropout=DROP)
    return _causal_lm(Qwen2MoeForCausalLM, cfg)


@model
def siglip():
    from transformers import SiglipConfig, SiglipModel
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=S, attention_dropout=DROP, bos_token_id=0, eos_token_id=2, pad_token_id=1)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=32,
                  patch_size=8, attention_dropout=DROP)
    model = _hf(SiglipModel, SiglipConfig(text_config=text, vision_config=vision))
    return model, (), {"input_ids": _ids(low=3), "pixel_values": _pixels(), "return_loss": True}, hf_loss


# ---------------------------------------------------------------- extras 3 (session 53): seq2seq, SSMs, RNNs, more PyG

@model
def t5():
    from transformers import T5Config, T5ForConditionalGeneration
    cfg = T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   relative_attention_num_buckets=8, dropout_rate=DROP, decoder_start_token_id=0, pad_token_id=0,
                   use_cache=False)
    model = _hf(T5ForConditionalGeneration, cfg)
    ids = _ids(low=1)
    labels = _ids(seed=2, seq=8, low=1)
    return model, (), {"input_ids": ids, "attention_mask": _padded_mask(), "labels": labels}, hf_loss


@model
def whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    cfg = WhisperConfig(vocab_size=V, num_mel_bins=8, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, d_model=32,
                        max_source_positions=16, max_target_positions=16, dropout=DROP, attention_dropout=DROP,
                        activation_dropout=DROP, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                        decoder_start_token_id=1, use_cache=False, mask_time_prob=0.0)
    model = _hf(WhisperForConditionalGeneration, cfg)
    feats = torch.randn(B, 8, 32, generator=torch.Generator().manual_seed(1))
    labels = _ids(seed=2, seq=8, low=3)
    return model, (), {"input_features": feats, "labels": labels}, hf_loss


@model
def vit_mae():
    from transformers import ViTMAEConfig, ViTMAEForPreTraining
    cfg = ViTMAEConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       image_size=32, patch_size=8, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                       decoder_num_attention_heads=4, decoder_intermediate_size=64, mask_ratio=0.5,
                       hidden_dropout_prob=DROP, attention_probs_dropout_prob=DROP)
    model = _hf(ViTMAEForPreTraining, cfg)
    return model, (), {"pixel_values": _pixels()}, hf_loss


@model
def deit():
    from transformers import DeiTConfig, DeiTForImageClassification
    cfg = DeiTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
                     patch_size=8, hidden_dropout_prob=DROP, attention_probs_dropout_prob=DROP, num_labels=5)
    return _img_cls(DeiTForImageClassification, cfg)


@model
def swinv2():
    from transformers import Swinv2Config, Swinv2ForImageClassification
    cfg = Swinv2Config(image_size=32, patch_size=4, num_channels=3, embed_dim=16, depths=[1, 1], num_heads=[2, 4],
                       window_size=4, mlp_ratio=2.0, hidden_dropout_prob=DROP, attention_probs_dropout_prob=DROP,
                       drop_path_rate=DROP, num_labels=5)
    return _img_cls(Swinv2ForImageClassification, cfg)


@model
def mamba():
    from transformers import MambaConfig, MambaForCausalLM
    cfg = MambaConfig(vocab_size=V, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
                      use_cache=False)
    return _causal_lm(MambaForCausalLM, cfg, mask=False)


@model
def gpt2_left_padded():
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(vocab_size=V, n_positions=S, n_embd=32, n_layer=2, n_head=4, resid_pdrop=DROP, embd_pdrop=DROP,
                     attn_pdrop=DROP, use_cache=False)
    model = _hf(GPT2LMHeadModel, cfg)
    ids = _ids()
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :4] = 0  # left padding
    return model, (), {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}, hf_loss


@model
def llama_left_padded():
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, use_cache=False, attention_dropout=DROP)
    model = _hf(LlamaForCausalLM, cfg)
    ids = _ids()
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, :5] = 0
    return model, (), {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}, hf_loss


class _LstmLM(nn.Module):
    def __init__(self, cell="lstm"):
        super().__init__()
        self.emb = nn.Embedding(V, 32)
        rnn = nn.LSTM if cell == "lstm" else nn.GRU
        self.rnn = rnn(32, 48, num_layers=2, batch_first=True, dropout=DROP)
        self.norm = nn.LayerNorm(48)
        self.head = nn.Linear(48, V)
        self.drop = nn.Dropout(DROP)

    def forward(self, ids):
        h, _ = self.rnn(self.drop(self.emb(ids)))
        return self.head(torch.nn.functional.gelu(self.norm(h)))


def _lm_loss(ids):
    def loss_fn(output, inputs):
        return F.cross_entropy(output[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
    return loss_fn


@model
def lstm_lm():
    torch.manual_seed(0)
    ids = _ids()
    return _LstmLM("lstm").train(), (ids,), {}, _lm_loss(ids)


@model
def gru_lm():
    torch.manual_seed(0)
    ids = _ids()
    return _LstmLM("gru").train(), (ids,), {}, _lm_loss(ids)


class _GraphCls(nn.Module):
    """GATv2 with edge features, TransformerConv, global mean pooling over a batch of 3 graphs."""

    def __init__(self):
        super().__init__()
        from torch_geometric.nn import GATv2Conv, TransformerConv
        self.c1 = GATv2Conv(FEATS, 16, heads=2, edge_dim=4, dropout=DROP)
        self.n1 = nn.LayerNorm(32)
        self.c2 = TransformerConv(32, 16, heads=2, edge_dim=4, dropout=DROP)
        self.head = nn.Linear(32, CLASSES)

    def forward(self, x, edge_index, edge_attr, batch):
        from torch_geometric.nn import global_mean_pool
        h = F.elu(self.n1(self.c1(x, edge_index, edge_attr)))
        h = F.elu(self.c2(h, edge_index, edge_attr))
        return self.head(global_mean_pool(h, batch, size=3))


@model
def pyg_graph_cls():
    torch.manual_seed(0)
    x, ei, _ = _graph()
    g = torch.Generator().manual_seed(5)
    edge_attr = torch.randn(EDGES, 4, generator=g)
    batch = torch.arange(NODES) * 3 // NODES
    y = torch.tensor([0, 2, 1])
    return _GraphCls().train(), (x, ei, edge_attr, batch), {}, (lambda out, inputs: F.cross_entropy(out, y))


@model
def pyg_pna():
    from torch_geometric.nn.models import PNA
    from torch_geometric.utils import degree
    torch.manual_seed(0)
    x, ei, y = _graph()
    d = degree(ei[1], NODES, dtype=torch.long)
    deg = torch.bincount(d, minlength=int(d.max()) + 1)
    model = PNA(FEATS, 32, num_layers=2, out_channels=CLASSES, aggregators=["mean", "max", "std"],
                scalers=["identity", "amplification"], deg=deg, dropout=DROP, norm="batch_norm").train()
    return model, (x, ei), {}, _node_loss(y)


class _PygStack(nn.Module):
    """Two PyG convolutions of one kind with a layer norm between, node classification."""

    def __init__(self, make):
        super().__init__()
        self.c1, self.c2 = make(FEATS, 32), make(32, CLASSES)
        self.norm = nn.LayerNorm(32)

    def forward(self, x, edge_index):
        return self.c2(F.dropout(F.relu(self.norm(self.c1(x, edge_index))), DROP, self.training), edge_index)


def _pyg_stack(make):
    torch.manual_seed(0)
    x, ei, y = _graph()
    return _PygStack(make).train(), (x, ei), {}, _node_loss(y)


@model
def pyg_sage_max():
    from torch_geometric.nn import SAGEConv
    return _pyg_stack(lambda i, o: SAGEConv(i, o, aggr="max"))


@model
def pyg_edgeconv():
    from torch_geometric.nn import EdgeConv
    return _pyg_stack(lambda i, o: EdgeConv(nn.Sequential(nn.Linear(2 * i, o), nn.ReLU(), nn.Linear(o, o)), aggr="max"))


@model
def pyg_genconv():
    from torch_geometric.nn import GENConv
    return _pyg_stack(lambda i, o: GENConv(i, o, aggr="softmax", learn_t=True, num_layers=2, norm="layer"))


@model
def pyg_graphconv_mean():
    from torch_geometric.nn import GraphConv
    return _pyg_stack(lambda i, o: GraphConv(i, o, aggr="mean"))


@model
def pyg_multi_aggr():
    from torch_geometric.nn import SAGEConv
    return _pyg_stack(lambda i, o: SAGEConv(i, o, aggr=["mean", "max", "min", "std"]))
