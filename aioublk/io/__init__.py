"""Host files: O_DIRECT alignment with its buffered fallback, and QEMU's
image locks. Shared by every target that keeps its data in files."""
