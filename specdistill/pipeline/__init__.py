"""Multi-stage jobs built from the packages below: regenerate -> train -> evaluate -> export."""
