import streamlit as st

st.title("plan")
st.info("This page is being built.")
