"""Cost per trained position of a Draft-OPD step vs the off-policy eagle3 step (shim over specdistill.cli.opd_cost).

  python scripts/opd_cost.py --steps 5 draft.path=outputs/eagle3/checkpoints/step-0000040/draft
"""
from specdistill.cli.opd_cost import main

if __name__ == "__main__":
    main()
