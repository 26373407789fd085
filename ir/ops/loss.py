"""Losses ONNX models carry: SoftmaxCrossEntropyLoss, NegativeLogLikelihoodLoss."""
from __future__ import annotations
