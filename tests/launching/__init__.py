"""kmp's tests: launching (kmp launch's machinery)."""
