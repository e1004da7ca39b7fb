"""A model zoo written from the libraries' own classes with small random configs (issue 30): one or more models per
family users bring (Hugging Face encoder-decoder, mixture of experts, ViT, left-padded decoder, state-space model,
speech; a CNN as torchvision writes ResNet; PyG layers with graph-level pooling; an LSTM). No downloads; each
builder is seeded and returns (model, args, kwargs, loss_fn) as a model file would (`loss_fn(output, inputs)`,
None for the default loss). `BUILDERS` maps each name to its builder.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

BATCH, SEQ, VOCAB = 2, 8, 64


def _tokens(seed: int = 1, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_loss(output, inputs):
    """The loss a Hugging Face model computes from the `labels` it is given."""
    return output["loss"]


# ============================================================================================ Hugging Face

def t5(batch: int = BATCH, eager: bool = False):
    """Encoder-decoder: T5ForConditionalGeneration with a padding mask and labels (teacher forcing); Hugging Face's
    default attention (SDPA), or `eager`: scores plus a position bias made from an embedding, softmax, dropout."""
    from transformers import T5Config, T5ForConditionalGeneration
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=4,
                   decoder_start_token_id=0, dropout_rate=0.1)
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    mask[1, -3:] = 0
    kwargs = {"input_ids": _tokens(batch=batch), "attention_mask": mask, "labels": _tokens(seed=2, batch=batch, seq=5)}
    model = T5ForConditionalGeneration(cfg)
    if eager:
        model.set_attn_implementation("eager")
    return model, (), kwargs, hf_loss


def mixtral():
    """Mixture of experts: MixtralForCausalLM, 4 experts, 2 per token, with labels."""
    from transformers import MixtralConfig, MixtralForCausalLM
    torch.manual_seed(0)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=32, use_cache=False)
    cfg._attn_implementation = "eager"
    ids = _tokens()
    return MixtralForCausalLM(cfg), (ids,), {"labels": ids}, hf_loss


def vit():
    """ViTForImageClassification on 16x16 images (16 patches), with class labels."""
    from transformers import ViTConfig, ViTForImageClassification
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=1,
                    num_attention_heads=4, intermediate_size=64, num_labels=5, hidden_dropout_prob=0.1)
    cfg._attn_implementation = "eager"
    pixels = torch.randn(BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(1))
    return ViTForImageClassification(cfg), (), {"pixel_values": pixels, "labels": torch.tensor([1, 3])}, hf_loss


def qwen2_left_padded():
    """Decoder-only training on a left-padded batch: Qwen2ForCausalLM (eager attention, grouped-query heads) with
    `attention_mask` zeros at the start of the shorter sequences and labels -100 there."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, use_cache=False)
    cfg._attn_implementation = "eager"
    ids = _tokens(batch=3)
    keep = torch.ones_like(ids)
    keep[0, :3] = 0
    keep[1, :1] = 0
    labels = ids.masked_fill(keep == 0, -100)
    return Qwen2ForCausalLM(cfg), (ids,), {"attention_mask": keep, "labels": labels}, hf_loss


def mamba():
    """State-space model: MambaForCausalLM (its selective scan as the per-timestep loop CPU runs), with labels."""
    from transformers import MambaConfig, MambaForCausalLM
    torch.manual_seed(0)
    cfg = MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=1, expand=2, conv_kernel=3,
                      use_cache=False)
    ids = _tokens()
    return MambaForCausalLM(cfg), (ids,), {"labels": ids}, hf_loss


def whisper():
    """Speech: WhisperForConditionalGeneration on log-mel input features (8 mel bins, 32 frames) with labels."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration
    torch.manual_seed(0)
    cfg = WhisperConfig(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=16, pad_token_id=0,
                        bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, use_cache=False)
    cfg._attn_implementation = "eager"
    features = torch.randn(BATCH, 8, 32, generator=torch.Generator().manual_seed(1))
    return WhisperForConditionalGeneration(cfg), (), {"input_features": features,
                                                      "labels": _tokens(seed=2, seq=6)}, hf_loss


# ============================================================================================ torchvision's ResNet

class BasicBlock(nn.Module):
    """torchvision's ResNet BasicBlock: two 3x3 convolutions with batch norm, a projected shortcut on a stride."""
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    """torchvision's ResNet (stem, four stages of blocks, global average pool, classifier) at chosen widths."""

    def __init__(self, layers=(1, 1, 1, 1), widths=(8, 16, 32, 64), num_classes: int = 10):
        super().__init__()
        self.inplanes = widths[0]
        self.conv1 = nn.Conv2d(3, self.inplanes, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(self.inplanes)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(widths[0], layers[0])
        self.layer2 = self._make_layer(widths[1], layers[1], stride=2)
        self.layer3 = self._make_layer(widths[2], layers[2], stride=2)
        self.layer4 = self._make_layer(widths[3], layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[3] * BasicBlock.expansion, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * BasicBlock.expansion:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * BasicBlock.expansion, 1, stride=stride,
                                                 bias=False), nn.BatchNorm2d(planes * BasicBlock.expansion))
        stage = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * BasicBlock.expansion
        stage += [BasicBlock(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*stage)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


RESNET_TARGETS = torch.tensor([3, 7])


def resnet_loss(output, inputs):
    """Cross-entropy against fixed class targets."""
    return F.cross_entropy(output, RESNET_TARGETS)


def resnet():
    """ResNet (BasicBlock, one block per stage, widths 8-64) on two 32x32 images."""
    torch.manual_seed(0)
    images = torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    return ResNet(), (images,), {}, resnet_loss


# ============================================================================================ PyG

NODES, EDGES, GRAPHS, FEATURES, EDGE_FEATURES = 12, 32, 3, 8, 4


class GraphClassifier(nn.Module):
    """Two message-passing layers (made by `make_conv(in, out)`), ReLU, `global_add_pool` per graph (its `size=`
    given, as export needs), a linear head."""

    def __init__(self, make_conv, hidden: int = 16, classes: int = 3, uses_edges: bool = False):
        super().__init__()
        self.convs = nn.ModuleList([make_conv(FEATURES, hidden), make_conv(hidden, hidden)])
        self.head = nn.Linear(hidden, classes)
        self.uses_edges = uses_edges

    def forward(self, x, edge_index, edge_attr, batch):
        from torch_geometric.nn import global_add_pool
        for conv in self.convs:
            x = conv(x, edge_index, edge_attr) if self.uses_edges else conv(x, edge_index)
            x = x.relu()
        return self.head(global_add_pool(x, batch, size=GRAPHS))


def _graph_batch():
    """Three small random graphs in one batch: node features, edges inside each graph, edge features, `batch`."""
    generator = torch.Generator().manual_seed(1)
    batch = torch.arange(GRAPHS).repeat_interleave(NODES // GRAPHS)
    per_graph = NODES // GRAPHS
    graph_of_edge = torch.randint(0, GRAPHS, (EDGES,), generator=generator)
    ends = torch.randint(0, per_graph, (2, EDGES), generator=generator) + graph_of_edge * per_graph
    x = torch.randn(NODES, FEATURES, generator=generator)
    edge_attr = torch.randn(EDGES, EDGE_FEATURES, generator=generator)
    return (x, ends, edge_attr, batch)


def _pyg(make_conv, uses_edges: bool = False):
    torch.manual_seed(0)
    return GraphClassifier(make_conv, uses_edges=uses_edges), _graph_batch(), {}, None


def pyg_sage():
    from torch_geometric.nn import SAGEConv
    return _pyg(lambda d_in, d_out: SAGEConv(d_in, d_out))


def pyg_gin():
    from torch_geometric.nn import GINConv
    return _pyg(lambda d_in, d_out: GINConv(nn.Sequential(nn.Linear(d_in, d_out), nn.ReLU(), nn.Linear(d_out, d_out)),
                                            train_eps=True))


def pyg_gatv2():
    """GATv2Conv with edge attributes, two heads concatenated."""
    from torch_geometric.nn import GATv2Conv
    return _pyg(lambda d_in, d_out: GATv2Conv(d_in, d_out // 2, heads=2, edge_dim=EDGE_FEATURES), uses_edges=True)


def pyg_transformer():
    """TransformerConv (graph attention with a root weight) with edge attributes."""
    from torch_geometric.nn import TransformerConv
    return _pyg(lambda d_in, d_out: TransformerConv(d_in, d_out // 2, heads=2, edge_dim=EDGE_FEATURES),
                uses_edges=True)


# ============================================================================================ LSTM

class LSTMAttentionTagger(nn.Module):
    """Token embeddings, a 2-layer LSTM reading them, `nn.MultiheadAttention` over its outputs, a tag head."""

    def __init__(self, dim: int = 32, tags: int = 6):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.rnn = nn.LSTM(dim, dim, num_layers=2, batch_first=True)
        self.attention = nn.MultiheadAttention(dim, num_heads=4, batch_first=True)
        self.head = nn.Linear(dim, tags)

    def forward(self, ids):
        states, _ = self.rnn(self.embed(ids))
        mixed, _ = self.attention(states, states, states, need_weights=False)
        return self.head(states + mixed)


def lstm():
    torch.manual_seed(0)
    return LSTMAttentionTagger(), (_tokens(),), {}, None


BUILDERS = {"t5": t5, "mixtral": mixtral, "vit": vit, "qwen2_left_padded": qwen2_left_padded, "mamba": mamba,
            "whisper": whisper, "resnet": resnet, "pyg_sage": pyg_sage, "pyg_gin": pyg_gin, "pyg_gatv2": pyg_gatv2,
            "pyg_transformer": pyg_transformer, "lstm": lstm}
