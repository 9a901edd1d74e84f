"""Runtime: the foundation every other layer stands on and which imports none of them:
transformers glue (hf), batch-invariant attention (exact), linear kernels (kernels), n-gram
tables (ngrams) and files on disk (files)."""
