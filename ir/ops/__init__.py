"""The registered op set. Importing this package registers every op, one module per family."""
from kiln.ir.ops import (  # noqa: F401
    activation, control, elementwise, indexing, layout, linalg, logic, nn, normalization, pool, reduce, shape,
    tensor)
from kiln.ir.ops import fused  # noqa: F401,E402  (kiln.FusedElementwise: the fusion pass's op)
from kiln.ir.ops import quant  # noqa: F401,E402  (DequantizeLinear: int8 weights of packed mobile files)
from kiln.ir.ops import assertion  # noqa: F401,E402  (kiln.Assert: run-time checks from scripted `assert`)
from kiln.ir.ops import guard  # noqa: F401,E402  (kiln.Guard: what a trace leaves where the model read tensor data)
from kiln.ir.ops import resize  # noqa: F401,E402  (Resize: ONNX Resize-19, issue 15)
from kiln.ir.ops import attention  # noqa: F401,E402  (Attention: ai.onnx's Attention-23..25)
from kiln.ir.ops import loss  # noqa: F401,E402  (SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss)
from kiln.ir.ops import rotary  # noqa: F401,E402  (RotaryEmbedding-23)
from kiln.ir.ops import grid_sample  # noqa: F401,E402  (GridSample-20/22)
from kiln.ir.ops import rnn  # noqa: F401,E402  (LSTM, GRU, RNN)
