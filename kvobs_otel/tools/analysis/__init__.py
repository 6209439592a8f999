"""Reading recorded spans back: episode reconstruction and checks."""
