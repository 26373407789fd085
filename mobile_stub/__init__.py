"""kiln.mobile_stub: the trimmed runtime for phones and small devices (runtime.py, kernels/), the packer that
turns a .kiln file into its packed form (pack.py: the selective op set, int8 or fp16 weights) and the bundler
that makes a numpy-only zipapp of both (bundle.py). See docs/ARCHITECTURE.md."""
