"""Operator surface identical to torch_npu, with reference implementations in PyTorch."""
