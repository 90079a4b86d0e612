"""kmp's tests: elastic."""
