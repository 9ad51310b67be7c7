from rstar_hpc.cli import main

main()
