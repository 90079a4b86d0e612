"""kmp's tests: install (kmp install-horovod and kmp doctor)."""
